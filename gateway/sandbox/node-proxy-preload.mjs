// sandbox-gateway Node preload: make `fetch` go through HTTPS_PROXY / HTTP_PROXY.
//
// Node 20's built-in fetch (undici) ignores the proxy variables, so SDKs built on it
// (openai, @anthropic-ai/sdk, ...) would try to connect directly and fail in a sandbox.
// Load it with NODE_OPTIONS="--import=/etc/sandbox-gateway/node-proxy-preload.mjs"
// (`sandbox-gateway env` prints that; `sandbox-gateway node-preload -o PATH` writes it).
//
// What it installs as fetch's global dispatcher:
//  - nothing, when no proxy variable is set or Node already proxies fetch itself
//    (NODE_USE_ENV_PROXY=1 on Node 24 and recent 22.x: its EnvHttpProxyAgent is in place);
//  - by default, Node's own undici Agent with a connector that opens each connection
//    to a host outside NO_PROXY as an HTTP CONNECT tunnel through the proxy
//    (credentials from the proxy URL), and puts a refused CONNECT's status line (the
//    gateway's code, reason and hint) into the error fetch raises. No package needed;
//  - with SANDBOX_GATEWAY_NODE_PROXY=undici (or if Node's Agent cannot be had), the
//    undici package's EnvHttpProxyAgent, required from the working directory, this
//    file's directory or NODE_PATH. It reports a refused CONNECT only as an aborted
//    request, without the gateway's reason.
// SANDBOX_GATEWAY_NODE_PROXY=builtin never uses the package; =off disables this file.
import { createRequire } from 'node:module';
import net from 'node:net';
import tls from 'node:tls';
import path from 'node:path';

const DISPATCHER = Symbol.for('undici.globalDispatcher.1');
const env = process.env;
const mode = (env.SANDBOX_GATEWAY_NODE_PROXY || 'auto').toLowerCase();

function proxyFor(protocol) {
  const value = protocol === 'https:' || protocol === 'wss:'
    ? env.HTTPS_PROXY || env.https_proxy || env.HTTP_PROXY || env.http_proxy
    : env.HTTP_PROXY || env.http_proxy;
  if (!value) return null;
  try {
    return new URL(value.includes('://') ? value : `http://${value}`);
  } catch {
    return null;
  }
}

function bypass(hostname, port) {
  const list = (env.NO_PROXY || env.no_proxy || '').toLowerCase();
  const host = hostname.toLowerCase().replace(/^\[|\]$/g, '');
  for (let entry of list.split(/[\s,]+/)) {
    if (!entry) continue;
    if (entry === '*') return true;
    let entryPort = null;
    const m = /^(.*):(\d+)$/.exec(entry);
    if (m && !entry.endsWith(']') && (m[1].includes('.') || !m[1].includes(':'))) {
      [, entry, entryPort] = m;
    }
    entry = entry.replace(/^\[|\]$/g, '').replace(/^\*?\./, '.');
    if (entryPort !== null && Number(entryPort) !== Number(port)) continue;
    if (entry.startsWith('.') ? host.endsWith(entry) || host === entry.slice(1) : host === entry) {
      return true;
    }
  }
  return false;
}

function authority(hostname, port) {
  const host = hostname.includes(':') && !hostname.startsWith('[') ? `[${hostname}]` : hostname;
  return `${host}:${port}`;
}

function secure(socket, hostname, servername, callback) {
  const bare = hostname.replace(/^\[|\]$/g, '');
  const options = { socket, host: bare, ALPNProtocols: ['http/1.1'] };
  if (!net.isIP(bare)) options.servername = servername || bare;
  const tlsSocket = tls.connect(options);
  tlsSocket.once('secureConnect', () => {
    tlsSocket.removeListener('error', callback);
    callback(null, tlsSocket);
  });
  tlsSocket.once('error', callback);
}

// One CONNECT tunnel through `proxy` to hostname:port; TLS inside it for https.
function tunnel(proxy, { hostname, protocol, port, servername }, callback) {
  let settled = false;
  const done = (err, socket) => {
    if (settled) return;
    settled = true;
    callback(err, socket);
  };
  const proxyPort = Number(proxy.port) || (proxy.protocol === 'https:' ? 443 : 80);
  const sock = proxy.protocol === 'https:'
    ? tls.connect({ host: proxy.hostname, port: proxyPort, servername: proxy.hostname })
    : net.connect({ host: proxy.hostname.replace(/^\[|\]$/g, ''), port: proxyPort });
  const target = authority(hostname, port);
  const head = [`CONNECT ${target} HTTP/1.1`, `Host: ${target}`];
  if (proxy.username || proxy.password) {
    const user = `${decodeURIComponent(proxy.username)}:${decodeURIComponent(proxy.password)}`;
    head.push(`Proxy-Authorization: Basic ${Buffer.from(user).toString('base64')}`);
  }
  const fail = (err) => {
    sock.destroy();
    done(err);
  };
  sock.setTimeout(30000, () => fail(new Error(`proxy ${proxy.host}: no answer to CONNECT ${target}`)));
  sock.once('error', fail);
  sock.once(proxy.protocol === 'https:' ? 'secureConnect' : 'connect', () => {
    sock.write(`${head.join('\r\n')}\r\n\r\n`);
  });
  let buf = Buffer.alloc(0);
  const onData = (chunk) => {
    buf = Buffer.concat([buf, chunk]);
    const end = buf.indexOf('\r\n\r\n');
    if (end < 0) {
      if (buf.length > 65536) fail(new Error(`proxy ${proxy.host}: oversized CONNECT answer`));
      return;
    }
    sock.removeListener('data', onData);
    sock.setTimeout(0);
    const lines = buf.subarray(0, end).toString('latin1').split('\r\n');
    const status = /^HTTP\/1\.[01] (\d{3})(?: (.*))?$/.exec(lines[0]);
    if (!status || status[1] !== '200') {
      const detail = lines.find((l) => /^proxy-status:/i.test(l));
      const err = new Error(`proxy refused CONNECT ${target}: ${lines[0].replace(/^HTTP\/1\.[01] /, '')}`);
      err.code = 'PROXY_CONNECT_REFUSED';
      err.statusCode = status ? Number(status[1]) : 0;
      if (detail) err.proxyStatus = detail.slice(detail.indexOf(':') + 1).trim();
      fail(err);
      return;
    }
    sock.removeListener('error', fail);
    const rest = buf.subarray(end + 4);
    if (rest.length) sock.unshift(rest);
    if (protocol === 'https:') {
      secure(sock, hostname, servername, (err, s) => (err ? fail(err) : done(null, s)));
    } else {
      done(null, sock);
    }
  };
  sock.on('data', onData);
}

function direct({ hostname, protocol, port, servername }, callback) {
  const bare = hostname.replace(/^\[|\]$/g, '');
  const sock = net.connect({ host: bare, port: Number(port) });
  sock.once('error', callback);
  sock.once('connect', () => {
    sock.removeListener('error', callback);
    if (protocol === 'https:') secure(sock, hostname, servername, callback);
    else callback(null, sock);
  });
}

function connector(options, callback) {
  const port = Number(options.port) || (options.protocol === 'https:' ? 443 : 80);
  const proxy = proxyFor(options.protocol);
  const target = { ...options, port };
  if (proxy && !bypass(options.hostname, port)) tunnel(proxy, target, callback);
  else direct(target, callback);
}

function undiciPackage() {
  const bases = [path.join(process.cwd(), 'noop.js'), import.meta.url];
  for (const base of bases) {
    try {
      const undici = createRequire(base)('undici');
      if (undici.EnvHttpProxyAgent && undici.setGlobalDispatcher) return undici;
    } catch {
      // not installed there
    }
  }
  return null;
}

async function builtinAgent() {
  if (!globalThis[DISPATCHER] && typeof fetch === 'function') {
    // Node creates its own dispatcher on first use; a data: URL makes it without I/O.
    await fetch('data:,').catch(() => {});
  }
  const Agent = globalThis[DISPATCHER] && globalThis[DISPATCHER].constructor;
  return typeof Agent === 'function' ? Agent : null;
}

async function install() {
  if (mode === 'off' || !(proxyFor('https:') || proxyFor('http:'))) return;
  const current = globalThis[DISPATCHER];
  if (current && current.constructor && current.constructor.name === 'EnvHttpProxyAgent') return;
  const Agent = mode === 'undici' ? null : await builtinAgent();
  if (Agent) {
    globalThis[DISPATCHER] = new Agent({ connect: connector });
    return;
  }
  const undici = mode === 'builtin' ? null : undiciPackage();
  if (undici) {
    undici.setGlobalDispatcher(new undici.EnvHttpProxyAgent());
    return;
  }
  process.emitWarning(`sandbox-gateway preload: cannot make fetch use the proxy (mode ${mode}; `
    + 'install the undici package or use a Node with NODE_USE_ENV_PROXY support)');
}

await install();
