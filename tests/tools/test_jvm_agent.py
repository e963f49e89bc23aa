"""The committed JVM agent jar is what its source builds: `make jvm-agent` with this
machine's javac gives the same class bytes (when the jar was built by the same JDK
version, which its manifest names), and the source compiles cleanly (-Xlint:all
-Werror) for Java 11."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

from gateway.tools.sandbox_env import jvm_agent_bytes

ROOT = Path(__file__).resolve().parents[2]
CLASS = "io/sandboxgateway/GatewayProxyAgent.class"


def test_the_jar_is_its_source(tmp_path: Path) -> None:
    javac = shutil.which("javac")
    assert javac, "javac is needed (scripts/test-tools.sh installs default-jdk-headless)"
    out = subprocess.run([javac, "-Xlint:all", "-Werror", "--release", "11", "-d",
                          str(tmp_path), *map(str, (ROOT / "gateway/sandbox/jvm").glob("*.java"))],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    built = (tmp_path / CLASS).read_bytes()
    with zipfile.ZipFile(io.BytesIO(jvm_agent_bytes())) as jar:
        shipped = jar.read(CLASS)
        manifest = jar.read("META-INF/MANIFEST.MF").decode()
    assert built[6:8] == shipped[6:8] == (55).to_bytes(2, "big")  # Java 11 class files
    version = subprocess.run([javac, "-version"], capture_output=True, text=True, timeout=60,
                             check=False).stdout.split()[-1]
    made_by = re.search(r"Created-By: (\S+)", manifest)
    assert made_by, manifest
    if made_by.group(1) == version:
        assert built == shipped, "the jar is stale: run `make jvm-agent` and commit it"
