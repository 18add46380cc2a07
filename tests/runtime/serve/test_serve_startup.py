"""`qruntime serve` starts its engine process before the HTTP side imports torch, Starlette or
uvicorn (serve/startup.py): the engine's load overlaps those imports. Checked in a fresh
interpreter, where sys.modules shows what was imported when the spawn happened; the spawn is
replaced by one that records that and stops the server. The options are checked and the port is
bound before it: a bad flag never spawns anything."""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = r"""
import json, sys
import qruntime.serve as serve
from qruntime.serve import startup
from qruntime.serve.options import ServeOptions

class Stop(Exception):
    pass

seen = {}

def spawn(load_kwargs, threads=None, setup=None, **kwargs):
    seen.update({name: name in sys.modules for name in ("torch", "uvicorn", "starlette", "qruntime.serve.server")})
    seen["path"], seen["graph_capture"] = load_kwargs["path"], load_kwargs["graph_capture"]
    raise Stop

startup.spawn_engine = spawn
try:
    serve.main(ServeOptions(sys.argv[1], port=0, log_level="warning", max_waiting=int(sys.argv[2]), graph_capture="load"))
except Stop:
    pass
except Exception as exc:
    seen["error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(seen))
"""


def _run(max_waiting: int) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, "some/artifact", str(max_waiting)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_engine_process_is_spawned_before_the_http_side_imports():
    seen = _run(max_waiting=8)
    assert seen == {
        "torch": False,
        "uvicorn": False,
        "starlette": False,
        "qruntime.serve.server": False,
        "path": "some/artifact",
        "graph_capture": "load",  # the options reach the engine's load
    }


def test_a_bad_option_spawns_nothing():
    seen = _run(max_waiting=0)
    assert seen == {"error": "RunError: --max-waiting must be >= 1 (got 0)"}
