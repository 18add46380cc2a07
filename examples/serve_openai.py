"""Serve a compiled artifact over the OpenAI-compatible HTTP API and talk to it with the official
`openai` client: a chat completion, a streamed completion and the model list.

    pip install openai 'qcompile-runtime[serve]'
    python examples/serve_openai.py [WORKDIR]     # default: a fresh temporary directory

The server log goes to WORKDIR/server.log, the responses to WORKDIR/responses.json. CPU only.
"""

import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import openai

work = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="qcompile-serve-"))
qcompile = [sys.executable, "-m", "qcompile"]
subprocess.run([*qcompile, "synth", "tiny", "-o", work / "ckpt", "--force"], check=True)
subprocess.run([*qcompile, "compile", work / "ckpt", "-o", work / "art", "--force", "-q"], check=True)

with socket.socket() as s:  # a free port (or pass --port 0: the server prints the one it took)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
url = f"http://127.0.0.1:{port}"
# `qruntime serve` is the same server, for machines with only the runtime installed
serve = [*qcompile, "serve", work / "art", "--host", "127.0.0.1", "--port", str(port)]
serve += ["--served-model-name", "tiny-fp8", "--device", "cpu", "--num-kv-blocks", "64"]
log = open(work / "server.log", "w")  # noqa: SIM115 (closed in finally, after the server)
server = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT)
try:
    deadline = time.monotonic() + 120  # wait until the model is loaded and the server answers
    while server.poll() is None and time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
    else:
        sys.exit(f"the server did not come up: see {work / 'server.log'}")

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")  # --api-key sets one
    chat = client.chat.completions.create(
        model="tiny-fp8", messages=[{"role": "user", "content": "Say hello."}], max_tokens=16, seed=0
    )
    reply = chat.choices[0]
    print(f"chat:   {reply.message.content!r} ({reply.finish_reason}, {chat.usage.completion_tokens} tokens)")

    print("stream: ", end="")
    chunks = []
    for chunk in client.completions.create(model="tiny-fp8", prompt="def main():", max_tokens=16, stream=True):
        chunks.append(chunk)
        print(chunk.choices[0].text, end="|", flush=True)  # `|` marks where each chunk ends
    print(f" ({chunks[-1].choices[0].finish_reason})")

    models = client.models.list().data
    print("models:", [m.id for m in models])
    replies = {"chat": chat, "stream": chunks, "models": models}
    (work / "responses.json").write_text(json.dumps(replies, default=lambda reply: reply.model_dump()))
finally:
    server.terminate()  # SIGTERM: stop accepting, let running requests finish, exit
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
    log.close()
