"""`make demo` (examples/demo/demo.py) runs end to end in bounded time: the gateway, a
stand-in provider and an agent configured only by `sandbox-gateway env`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parent.parent / "examples" / "demo" / "demo.py"


def test_demo_shows_the_key_swap_and_a_refusal() -> None:
    out = subprocess.run([sys.executable, str(DEMO)], capture_output=True, text=True,
                         timeout=90, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "agent: chat.completions.create -> 'Hello from the provider!'" in text
    assert "upstream saw the real key (sk-demo-REAL...); the agent held only its token" in text
    assert "POST https://evil.example/upload -> refused: 403 policy_denied: no rule" in text
    assert "allow POST    api.openai.com/v1/chat/completions  status=200 credential=openai" in text
    assert "deny  CONNECT evil.example  status=403" in text
    assert text.rstrip().endswith("demo OK")
    assert "sk-demo-REAL-provider-key" not in text  # the demo never prints the key whole
