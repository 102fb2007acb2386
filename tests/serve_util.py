"""Start a real ``omniloop serve`` subprocess on free loopback ports and wait for /ready."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from omniloop.models.fake import decode_codes, frame_codes

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProc:
    proc: subprocess.Popen
    port: int
    zmq_addr: str
    api_key: str | None = None
    log_path: Path | None = None
    children: list[int] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path and self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"server did not exit within {timeout_s} s\n{self.log()}")


def start_server(tmp_path: Path, profile: str = "fake", *args: str, api_key: str | None = None,
                 timeout_s: float = 60.0) -> ServerProc:
    port, zmq_port = free_port(), free_port()
    zmq_addr = f"tcp://127.0.0.1:{zmq_port}"
    cmd = [sys.executable, "-m", "omniloop", "serve", profile, "--port", str(port), "--zmq", zmq_addr, *args]
    if api_key:
        cmd += ["--api-key", api_key]
    log_path = tmp_path / f"server-{port}.log"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    server = ServerProc(proc, port, zmq_addr, api_key, log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode} before ready\n{server.log()}")
        try:
            if httpx.get(f"{server.url}/ready", headers=server.headers(), timeout=1.0).status_code == 200:
                import psutil

                server.children = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    server.stop(signal.SIGKILL)
    raise AssertionError(f"server not ready within {timeout_s} s\n{server.log()}")


def expected_pcm(text: str, max_frames: int | None = None) -> np.ndarray:
    """What the fake talker+codec produce for ``text`` (frames_per_char 1)."""
    total = max(1, len(text))
    if max_frames is not None:
        total = min(total, max_frames)
    return decode_codes(frame_codes(text, 0, total))


def s16(pcm: np.ndarray) -> np.ndarray:
    return np.rint(np.clip(pcm, -1, 1) * 32767).astype(np.int16)


def metric(text: str, name: str) -> float:
    """The value of one sample line ``name`` (with labels, exactly as rendered) in /metrics text."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name} not in metrics")


def wait_idle(server: ServerProc, timeout_s: float = 10.0) -> str:
    """Poll /metrics until no request runs in the frontend or the engine; returns the last scrape."""
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        text = httpx.get(f"{server.url}/metrics", headers=server.headers()).text
        if metric(text, "omniloop:num_requests_running") == 0 and metric(text, "omniloop:engine_num_pending") == 0:
            return text
        time.sleep(0.1)
    raise AssertionError(f"requests still running after {timeout_s} s:\n{text}")
