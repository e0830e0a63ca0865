"""`rq info` keeps working on our queues, and what its registry cleanup writes (it re-saves
an abandoned JSON job's meta with pickle) cannot hurt us."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from rq import Retry

from conftest import wait_for
from jobs.runtime import PayrunJob, RenderWorker, make_queue, recover_meta
from payrun import keys

RQ = str(Path(sys.executable).parent / "rq")


def abandon(conn, job_id: str) -> PayrunJob:
    """A job whose worker was killed long ago: its lease in rq:wip has expired."""
    q = make_queue(keys.RENDER_QUEUE, conn)
    job = q.enqueue_call("jobs.testing.noop", job_id=job_id, retry=Retry(max=2),
                         meta={"kind": "render", "attempt": 1, "key": "slip:2026-11:emp-1",
                               "retry": {"base_s": 0.1, "cap_s": 0.2, "attempts": 3}})
    conn.lrem(q.key, 0, job_id)
    conn.zadd(f"rq:wip:{keys.RENDER_QUEUE}", {f"{job_id}:exec-1": time.time() - 120})
    conn.hset(job.key, mapping={"status": "started", "worker_name": "render.gone.1"})
    return job


def test_rq_info_lists_our_queues_and_workers(conn, redis_url):
    make_queue(keys.RENDER_QUEUE, conn).enqueue_call("jobs.testing.noop", job_id="listed-1")
    for flags in ([], ["--raw"], ["-R"]):
        out = subprocess.run([RQ, "info", "-u", redis_url, *flags], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert keys.RENDER_QUEUE in out.stdout


def _rq_env(cfg) -> dict[str, str]:
    """The environment `eval "$(payrun config rq-env)"` gives a shell."""
    import shlex

    from click.testing import CliRunner

    from payrun.cli import cli

    out = CliRunner().invoke(cli, ["config", "rq-env"])
    assert out.exit_code == 0, out.output
    env = {k: v for k, v in os.environ.items() if not k.startswith("RQ_")}
    for line in out.output.splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        env[name] = shlex.split(value)[0]
    return env


def test_rq_info_with_payrun_config_rq_env_never_unpickles_and_keeps_the_url_out_of_ps(conn, redis_url, cfg, tmp_path):
    """Security review: plain `rq info` reads an abandoned job's meta with pickle, so
    whoever can write to Redis could run code in the operator's shell; and `-u URL` puts
    the password in every local user's `ps`. The README's way is
    `eval "$(payrun config rq-env)"`: the URL in the environment, our JSON classes."""
    import pickle

    flag = tmp_path / "pwned"

    class Boom:
        def __reduce__(self):
            return (os.system, (f"touch {flag}",))

    env = _rq_env(cfg)
    assert env["RQ_REDIS_URL"] == redis_url and env["RQ_QUEUE_CLASS"] == "jobs.runtime.PayrunQueue"
    abandon(conn, "abandoned-bomb")
    conn.hset("rq:job:abandoned-bomb", "meta", pickle.dumps(Boom()))
    abandon(conn, "abandoned-2")
    for flags in ([], ["--raw", "-Q"], ["-R"]):
        out = subprocess.run([RQ, "info", *flags], capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == 0, out.stderr
        assert keys.RENDER_QUEUE in out.stdout
    assert not flag.exists()
    assert conn.hget("rq:job:abandoned-2", "meta")[:1] == b"{"  # the cleanup re-saved it as JSON
    assert PayrunJob.fetch("abandoned-2", connection=conn).meta["key"] == "slip:2026-11:emp-1"
    # the control: plain rq (pickle) does run it
    conn.flushdb()
    abandon(conn, "abandoned-bomb")
    conn.hset("rq:job:abandoned-bomb", "meta", pickle.dumps(Boom()))
    subprocess.run([RQ, "info", "-u", redis_url], capture_output=True, text=True, timeout=60,
                   env={k: v for k, v in env.items() if not k.startswith("RQ_")})
    assert flag.exists()


def test_rq_requeue_worker_and_empty_with_payrun_config_rq_env_never_unpickle(conn, cfg, tmp_path):
    """Security review (session 39): rq's other commands pass their `--serializer` default,
    pickle, by name, and our classes kept any serializer that was not None: `rq requeue
    --all` under `payrun config rq-env` unpickled a failed job's meta, and `rq worker
    --with-scheduler` a due scheduled job's (code run in the operator's shell by whoever
    can write to Redis)."""
    import pickle

    from rq.registry import FailedJobRegistry
    from rq.serializers import JSONSerializer, PickleSerializer

    flag = tmp_path / "pwned"

    class Boom:
        def __reduce__(self):
            return (os.system, (f"touch {flag}",))

    env = _rq_env(cfg)
    q = make_queue(keys.EMAIL_QUEUE, conn)
    for job_id in ("failed-bomb", "waiting-bomb"):
        job = q.enqueue_call("jobs.testing.noop", job_id=job_id, meta={"kind": "email"})
        conn.hset(job.key, "meta", pickle.dumps(Boom()))
    conn.lrem(q.key, 0, "failed-bomb")
    conn.zadd(f"rq:failed:{keys.EMAIL_QUEUE}", {"failed-bomb": time.time() + 3600})
    job = q.enqueue_call("jobs.testing.noop", job_id="scheduled-bomb", meta={"kind": "email"})
    conn.lrem(q.key, 0, "scheduled-bomb")
    conn.hset(job.key, "meta", pickle.dumps(Boom()))
    conn.zadd(f"rq:scheduled:{keys.EMAIL_QUEUE}", {"scheduled-bomb": int(time.time()) - 5})
    for args in (["requeue", "--queue", keys.EMAIL_QUEUE, "--all"], ["worker", "--burst", "--with-scheduler", keys.EMAIL_QUEUE],
                 ["empty", keys.EMAIL_QUEUE]):
        out = subprocess.run([RQ, *args], capture_output=True, text=True, timeout=60, env=env)
        # (the worker's scheduler, RQ's own Job class, stops on the meta it cannot read as JSON)
        assert out.returncode == 0 or args[0] == "worker", out.stderr
        assert not flag.exists(), args
    assert PayrunJob("x", conn, PickleSerializer).serializer is JSONSerializer
    assert PayrunJob("x", connection=conn, serializer="pickle").serializer is JSONSerializer
    assert FailedJobRegistry(keys.EMAIL_QUEUE, connection=conn, job_class=PayrunJob,
                             serializer=PickleSerializer).job_class is PayrunJob
    from jobs.runtime import PayrunQueue
    assert PayrunQueue("x", connection=conn, serializer="rq.serializers.DefaultSerializer").serializer is JSONSerializer
    assert PayrunQueue("x", conn, None, True, None, PickleSerializer).serializer is JSONSerializer


def test_rq_info_interval_mode_runs(conn, redis_url):
    """`rq info -i` keeps refreshing: two screens seen (however long the CLI takes to start
    on a loaded host), and it is still running."""
    import threading

    p = subprocess.Popen([RQ, "info", "-u", redis_url, "-i", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: p.stdout.read1(4096), b"")), daemon=True)
    reader.start()
    try:
        wait_for(lambda: b"".join(chunks).count(b"queues") >= 2 or p.poll() is not None, timeout_s=60,
                 what="two refreshes of rq info -i")
        assert p.poll() is None  # still refreshing, as it should
    finally:
        p.terminate()
        p.wait(timeout=10)
        reader.join(10)
    assert b"".join(chunks).count(b"queues") >= 2


def test_rq_info_cleanup_cannot_corrupt_a_job(conn, redis_url, cfg, monkeypatch):
    abandon(conn, "abandoned-1")
    out = subprocess.run([RQ, "info", "-u", redis_url], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    raw_meta = conn.hget("rq:job:abandoned-1", "meta")
    assert raw_meta[:1] == b"\x80"  # rq info really did re-save it with pickle
    job = PayrunJob.fetch("abandoned-1", connection=conn)
    assert job.meta["key"] == "slip:2026-11:emp-1" and job.meta["retry"]["attempts"] == 3
    # and it still runs to completion in a payrun worker
    monkeypatch.setenv("PAYRUN_TEST_JOBS", "1")
    wait_for(lambda: job.get_status(refresh=True) == "queued", timeout_s=10, what="rq info's retry to queue it")
    RenderWorker([make_queue(keys.RENDER_QUEUE, conn)], connection=conn).work(burst=True, logging_level="WARNING")
    assert PayrunJob.fetch("abandoned-1", connection=conn).get_status() == "finished"


def test_recover_meta_never_unpickles():
    import pickle

    class Boom:
        def __reduce__(self):
            return (os.system, ("echo pwned > /tmp/payrun-should-not-exist",))

    evil = {"unserialized": pickle.dumps(Boom())}
    assert recover_meta(evil) == {}
    assert not os.path.exists("/tmp/payrun-should-not-exist")
    good = {"unserialized": pickle.dumps({"unserialized": b'{"kind": "email"}'})}
    assert recover_meta(good) == {"kind": "email"}
    assert recover_meta({"kind": "render"}) == {"kind": "render"}


def test_a_job_naming_another_function_is_refused(conn, monkeypatch):
    q = make_queue(keys.RENDER_QUEUE, conn)
    q.enqueue_call("os.system", args=("echo pwned > /tmp/payrun-os-system",), job_id="evil-1")
    RenderWorker([q], connection=conn).work(burst=True, logging_level="WARNING")
    job = PayrunJob.fetch("evil-1", connection=conn)
    assert job.get_status() == "failed" and "refused" in job.meta["last_error"]
    assert not os.path.exists("/tmp/payrun-os-system")


def _callback_touch(*args, **kwargs):
    """A callback a forged job names: leaves a mark wherever it runs (the horse too)."""
    Path(os.environ["PAYRUN_TEST_CALLBACK_FLAG"]).touch()


def test_a_job_naming_callbacks_has_them_dropped_not_called(conn, tmp_path, monkeypatch):
    """Security review: RQ imports and calls the success/failure callbacks named in a job's
    hash even when perform() refuses the job's function."""
    flag = tmp_path / "called"
    monkeypatch.setenv("PAYRUN_TEST_CALLBACK_FLAG", str(flag))
    monkeypatch.setenv("PAYRUN_TEST_JOBS", "1")
    q = make_queue(keys.RENDER_QUEUE, conn)
    q.enqueue_call("os.system", args=("true",), job_id="evil-2")
    q.enqueue_call("jobs.testing.noop", job_id="evil-3")
    for job_id in ("evil-2", "evil-3"):
        conn.hset(f"rq:job:{job_id}", mapping={"failure_callback_name": f"{__name__}._callback_touch",
                                               "success_callback_name": f"{__name__}._callback_touch"})
    RenderWorker([q], connection=conn).work(burst=True, logging_level="WARNING")
    assert PayrunJob.fetch("evil-2", connection=conn).get_status() == "failed"
    assert PayrunJob.fetch("evil-3", connection=conn).get_status() == "finished"
    assert not flag.exists()


def test_rq_info_lists_a_workers_queue_before_its_first_job(conn, redis_url):
    """RQ lists a queue once something was enqueued to it: the control queue (a job a
    month, a tick every 15 minutes) and its worker were missing from `rq info -R` until
    then. Workers list their queues as they start."""
    from jobs.runtime import register_queues, run_lanes

    control = make_queue(keys.CONTROL_QUEUE, conn)
    assert control.key.encode() not in conn.smembers("rq:queues")
    w = RenderWorker([control], connection=conn, name="control.test.1")
    w.work(burst=True)  # no job: starts, finds nothing, stops
    assert run_lanes(conn, [keys.EMAIL_QUEUE], 1, burst=True) == 0
    names = {q.name for q in make_queue(keys.RENDER_QUEUE, conn).all(connection=conn)}
    assert {keys.CONTROL_QUEUE, keys.EMAIL_QUEUE} <= names
    out = subprocess.run([RQ, "info", "-u", redis_url, "-R"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert keys.CONTROL_QUEUE in out.stdout and keys.EMAIL_QUEUE in out.stdout
    register_queues(conn, [])  # nothing to list: no error


def test_payruns_rq_worker_class_is_json_however_rq_passes_its_arguments(conn):
    """rq's `rq worker` builds its worker class by keyword; a script may pass them by
    position: either way pickle named as the serializer becomes JSON, and no job or
    queue class named means payrun's (an index one off replaced the wrong argument)."""
    from rq.serializers import DefaultSerializer, JSONSerializer

    from jobs.runtime import PayrunJob, PayrunQueue, PayrunRqWorker

    by_name = PayrunRqWorker(["q"], connection=conn, serializer=DefaultSerializer)
    by_position = PayrunRqWorker(["q"], "w-pos", 500, conn, None, 600, None, 420, None, None, True, 30, False,
                                 True, DefaultSerializer)
    for w in (by_name, by_position):
        assert w.serializer is JSONSerializer and w.job_class is PayrunJob and w.queue_class is PayrunQueue
