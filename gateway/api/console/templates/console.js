// The request log's live stream: new audit lines from /console/requests/stream
// (server-sent events) added at the top of the table. Everything else in the console
// works without this script. Text only (textContent): a line's fields are never HTML.
(() => {
  "use strict";
  const lines = document.querySelector("table[data-stream]");
  if (!lines || !window.EventSource) return;
  const refused = document.querySelector("table[data-refused]");
  const status = document.getElementById("live");
  const KEEP = 500;
  const cell = (tr, text) => {
    const td = tr.insertCell();
    td.textContent = text == null ? "" : String(text);
    return td;
  };
  const row = (r) => {
    const tr = document.createElement("tr");
    tr.className = (r.refused ? "refused " : "") + "new";
    const when = tr.insertCell();
    when.className = "when";
    const link = document.createElement("a");
    link.href = "/console/requests/" + encodeURIComponent(r.id);
    link.title = r.time;
    link.textContent = String(r.time).slice(5, 10) + " " + String(r.time).slice(11, 19);
    when.appendChild(link);
    cell(tr, r.sandbox);
    cell(tr, r.policy);
    cell(tr, r.method);
    cell(tr, (r.host || "") + (r.port ? ":" + r.port : "") + (r.path || "")).className = "target";
    const decision = tr.insertCell();
    const badge = document.createElement("span");
    badge.className = "decision " + r.decision;
    badge.textContent = r.decision;
    decision.appendChild(badge);
    if (r.error) {
      const code = document.createElement("code");
      code.textContent = r.error;
      decision.append(" ", code);
    }
    cell(tr, r.status);
    cell(tr, r.engine);
    cell(tr, r.rule);
    return tr;
  };
  const add = (table, tr) => {
    const body = table.tBodies[0];
    body.insertBefore(tr, body.firstChild);
    while (body.rows.length > KEEP) body.deleteRow(-1);
  };
  const source = new EventSource(lines.dataset.stream);
  source.onopen = () => { status.textContent = "Live: new lines appear at the top."; };
  source.onerror = () => { status.textContent = "Live stream interrupted; reconnecting…"; };
  source.addEventListener("problem", (event) => { status.textContent = event.data; });
  source.onmessage = (event) => {
    const r = JSON.parse(event.data);
    add(refused && r.refused ? refused : lines, row(r));
  };
})();
