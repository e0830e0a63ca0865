"""The job functions: plain functions of JSON data. The runtime (jobs/runtime.py) wraps
them with retries, the ledger events and shutdown handling.

render_slip(snapshot)  pdf-render: HTML -> PDF in the slip store, then enqueue the send
send_slip(payload)     send-email: claim the idempotency key, send, mark it sent
"""

from __future__ import annotations

import errno
import functools
import json
import os
import logging
import threading
import time
from pathlib import Path
from typing import Any

from rq import Retry, get_current_job

from jobs import events, idempotency, policy, senders, unrecorded
from jobs.errors import (AccountRefused, ClaimLost, PermanentError, ProviderDown, RateWait, RefusedHere, RenderPending,
                         SlipMissing, StoreFull, StoreUnsafe, StoreUnwritable, Throttled)
from jobs.policy import (REISSUE_FIELDS, RECORD_MARGIN_S, counts_as_provider_failure, job_end, pauses_every_sender,
                         record_retry_wait_s, redis_refuses_writes, send_claim_ttl_s, send_may_start, send_timeout_s,
                         send_window, slip_path_problem)
from payrun import config as config_mod
from payrun import keys, slipstore

log = logging.getLogger("payrun.jobs")
sends_log = logging.getLogger("payrun.sends")  # one line per request, at DEBUG (payrun.logs.debug_loggers)

ALLOWED_FUNCTIONS = frozenset({
    "jobs.tasks.render_slip",
    "jobs.tasks.send_slip",
    "jobs.tasks.noop",
    "jobs.oneoff.resend_slip",
    "jobs.oneoff.send_reminder",
    "scheduler.ticks.run_tick",
    "scheduler.ticks.record_not_run",
    "scheduler.ticks.reap",
    "scheduler.bank.check_company",
})
"""Job functions a payrun worker agrees to run (JSON still lets a job name any import path)."""

TEST_FUNCTIONS = frozenset({"jobs.testing.hang", "jobs.testing.sleep", "jobs.testing.noop", "jobs.testing.spin",
                            "jobs.testing.throttled_once", "jobs.testing.flaky", "jobs.testing.held_then_flaky",
                            "jobs.testing.loses_its_first_timeout"})


def allowed_functions() -> frozenset[str]:
    """The allow-list, plus the test suite's jobs when PAYRUN_TEST_JOBS=1."""
    import os

    if os.environ.get("PAYRUN_TEST_JOBS") == "1":
        return ALLOWED_FUNCTIONS | TEST_FUNCTIONS
    return ALLOWED_FUNCTIONS


@functools.lru_cache(maxsize=1)
def settings() -> config_mod.Config:
    """This process's configuration (loaded once; workers are restarted to change it)."""
    return config_mod.load()


def slip_relpath(month: str, company_id: int, employee_id: str) -> str:
    """Where a slip lives under the slip store; PermanentError for parts that would put it
    elsewhere (jobs.policy.slip_path_problem)."""
    if why := slip_path_problem(month, company_id, employee_id):
        raise PermanentError(f"refused to write a slip: {why}")
    return f"{month}/{company_id}/{employee_id}.pdf"


def _retry(policy: config_mod.RetryPolicy) -> Retry | None:
    # RQ counts retries after the first try; intervals come from PayrunJob.get_retry_interval.
    return Retry(max=policy.attempts - 1) if policy.attempts > 1 else None


def email_payload(snapshot: dict[str, Any], rel: str) -> dict[str, Any]:
    emp = snapshot["employee"]
    return {
        "month": snapshot["month"],
        "key": snapshot["key"],
        "company_id": snapshot["company"]["id"],
        "company_name": snapshot["company"]["name"],
        "employee_id": emp["id"],
        "to": emp["email"],
        "to_name": emp["name_en"],
        "slip": rel,
        **{k: snapshot[k] for k in REISSUE_FIELDS if snapshot.get(k)},  # (the email says it replaces one)
        # a leaver's slip of the month they left in: the email says it is their final one, as the slip does
        **({"final": final} if (final := policy.final_day(snapshot["month"], snapshot.get("final"))) else {}),
    }


_email_enqueuers: dict[int, Any] = {}
_email_enqueuers_lock = threading.Lock()


def _per_connection(cache: dict[int, Any], lock: threading.Lock, conn, which, build):
    """The object ``build()`` made for this Redis connection (and ``which`` options), made
    once: each send lane and render worker has its own connection, so each builds its own
    once, not again whenever the caller before it used another one. A cache keyed by
    ``id(conn)`` checks the connection itself, as ids are reused after one is freed."""
    with lock:
        got = cache.get(id(conn))
        if got is not None and got[0] is conn and got[1] == which:
            return got[2]
        if len(cache) > 256:  # connections come and go in tests and tools
            cache.clear()
        made = build()
        cache[id(conn)] = (conn, which, made)
        return made


def _email_enqueuer(conn, cfg: config_mod.Config):
    """This connection's one-script enqueue of send jobs (payrun.bulk.OneEnqueuer) for
    ``cfg``'s send options, built once; None if this RQ's enqueue cannot be repeated."""
    from jobs.runtime import make_queue
    from payrun import bulk

    def build():
        tpl = bulk.template(make_queue(keys.EMAIL_QUEUE, conn), SEND_FUNC, **_email_job_options(cfg))
        return bulk.OneEnqueuer(conn, tpl, keys.EVENTS_STREAM) if tpl is not None else None

    return _per_connection(_email_enqueuers, _email_enqueuers_lock, conn,
                           (cfg.email.timeout_s, cfg.email.retry.attempts), build)


SEND_FUNC = "jobs.tasks.send_slip"


def _email_job_options(cfg: config_mod.Config) -> dict[str, Any]:
    """RQ's options of a send job (its timeout, retries and how long its record stays)."""
    return dict(timeout=cfg.email.timeout_s, retry=_retry(cfg.email.retry), result_ttl=24 * 3600,
                failure_ttl=30 * 24 * 3600)


def enqueue_email(conn, cfg: config_mod.Config, payload: dict[str, Any]) -> str | None:
    """Enqueue the send job for a rendered slip, once: a render retried after this
    already happened finds the job and leaves it alone. The ledger's "queued" event is
    written first, atomically with the job (one script: payrun.bulk.OneEnqueuer)."""
    job_id, meta, fields, description = _send_job(cfg, payload)
    enq = _email_enqueuer(conn, cfg)
    if enq is not None:
        if not enq.enqueue(job_id, payload, description, meta, events.event(job_id, "queued", **fields)):
            return None
        events.log_emitted(job_id, "queued", **fields)
        return job_id
    from jobs.runtime import make_queue  # an RQ whose enqueue payrun.bulk cannot repeat: RQ's own

    queue = make_queue(keys.EMAIL_QUEUE, conn)
    if conn.exists(queue.job_class.key_for(job_id)):
        return None
    with conn.pipeline() as pipe:
        pipe.multi()  # the event and the job land together, event first
        events.emit(pipe, job_id, "queued", **fields)
        queue.enqueue_call(SEND_FUNC, args=(payload,), job_id=job_id, description=description, meta=meta,
                           pipeline=pipe, **_email_job_options(cfg))
        pipe.execute()
    return job_id


FINISH_KEY = "_finish"
"""In a render's return value: what is left to do (see hand_finish_over, finish_render)."""

_hand_finish_over = False


def hand_finish_over(on: bool = True) -> None:
    """In this process, render_slip stops once the slip is written, before it is durable
    and before its send exists, and returns what is left under FINISH_KEY. Its render
    worker does the rest (finish_render) while this process renders the next slip: the
    two syncs of the durable write are then waited out beside a render, not before the
    next one. Only a warm horse (jobs.runtime.RenderWorker) turns it on."""
    global _hand_finish_over
    _hand_finish_over = on


def render_slip(snapshot: dict[str, Any]) -> dict[str, Any]:
    from jobs import slip

    cfg = settings()
    job = get_current_job()
    rel = slip_relpath(snapshot["month"], snapshot["company"]["id"], snapshot["employee"]["id"])
    holds = int(job.meta.get("store_full_holds") or 0) if job is not None else 0
    if holds and (free := slip.free_bytes(cfg.slips_dir)) is not None and free < policy.STORE_ROOM_MIN_BYTES:
        # held for a full store, and still full: wait again without rendering (one statvfs)
        raise _store_full(cfg, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), holds)
    if holds and (failing := slipstore.probe_write(cfg.slips_dir)) is not None and policy.is_store_failing(failing):
        # held, and the store still cannot be written: wait again without rendering (one test write)
        raise _store_unwritable(cfg, job.connection, failing, holds)
    pdf = slip.render_pdf(snapshot)  # raises PermanentError on bad data
    try:
        if job is not None and int(job.meta.get("attempt") or 1) > 1:  # an earlier try may have died mid-write
            timeout_s = job.timeout if isinstance(job.timeout, int) and job.timeout > 0 else cfg.render.timeout_s
            # (another host's stage only once its try's timeout and lease are over: the store is shared)
            slip.remove_dead_stages(cfg.slips_dir / rel, lease=(timeout_s, cfg.lease.visibility_s))
        if job is not None and _hand_finish_over:
            tmp = slip.stage_slip(cfg.slips_dir / rel, pdf, store=cfg.slips_dir)
            return {"slip": rel, "bytes": len(pdf),
                    FINISH_KEY: {"staged": str(tmp), "email": email_payload(snapshot, rel), "store_full_holds": holds}}
        slip.write_slip(cfg.slips_dir / rel, pdf, store=cfg.slips_dir)
    except OSError as e:
        if policy.is_store_full(e):
            raise _store_full(cfg, e, holds) from e
        if (held := _store_fault(cfg, job.connection if job is not None else None, e, holds)) is not None:
            raise held from e
        raise
    if job is not None:
        enqueue_email(job.connection, cfg, email_payload(snapshot, rel))
    return {"slip": rel, "bytes": len(pdf)}


def _store_full(cfg: config_mod.Config, e: OSError, holds: int) -> StoreFull:
    """The StoreFull a render raises when its slip store has no room (jobs.errors)."""
    from jobs import slip

    wait = policy.store_full_wait_s(holds)
    return StoreFull(policy.store_full_text(str(cfg.slips_dir), e, slip.free_bytes(cfg.slips_dir), wait),
                     retry_after_s=wait)


def _store_fault(cfg: config_mod.Config, conn, e: OSError, holds: int) -> StoreUnwritable | None:
    """The StoreUnwritable a render raises when its slip's write, sync or rename failed with
    EROFS, or with EIO and a test write in the store fails too (jobs.policy.store_fault_held);
    None when the failure is this slip's alone (an ordinary failed attempt)."""
    if not policy.is_store_failing(e):
        return None
    probed = slipstore.probe_write(cfg.slips_dir)
    if not policy.store_fault_held(e.errno, probed.errno if probed is not None else None):
        return None
    return _store_unwritable(cfg, conn, probed if probed is not None and policy.is_store_failing(probed) else e, holds)


def _store_unwritable(cfg: config_mod.Config, conn, e: OSError, holds: int) -> StoreUnwritable:
    """The StoreUnwritable a render raises (jobs.errors), recorded in Redis for this host's
    render workers (they take no render until a test write succeeds) and `payrun status`."""
    if conn is not None:
        slipstore.report_fault(conn, cfg.slips_dir, e)
    wait = policy.store_full_wait_s(holds)
    return StoreUnwritable(policy.store_unwritable_text(str(cfg.slips_dir), e, str(slipstore.mount_point(cfg.slips_dir)),
                                                        wait), retry_after_s=wait)


def finish_render(conn, result: dict[str, Any]) -> dict[str, Any]:
    """The rest of a render_slip that handed its finish over: the staged slip made
    durable and put in place (jobs.slip.commit_slip), then its send enqueued. Returns
    the render's result as render_slip would have."""
    commit_render(conn, result)
    enqueue_email(conn, settings(), result[FINISH_KEY]["email"])
    return finished_render(result)


def commit_render(conn, result: dict[str, Any]) -> None:
    """The first half of finish_render: the staged slip made durable and put in place,
    its send not enqueued yet. Raises as finish_render does."""
    error = commit_renders(conn, [result])[0]
    if error is not None:
        raise error


def commit_renders(conn, results: list[dict[str, Any]]) -> list[BaseException | None]:
    """commit_render for a batch's renders (their sends go in one transaction after it:
    enqueue_email_in): each staged slip made durable and put in place, then each folder
    they went into synced once, not once per slip (16 folder syncs fewer per batch: a
    batch's commits took 7-52 ms, session 46). Returns for each result None (its slip is
    durable and in place) or the error commit_render raises for it; a folder whose sync
    fails fails every slip put in it."""
    from jobs import slip

    cfg = settings()
    errors: list[BaseException | None] = [None] * len(results)
    placed: dict[Path, list[int]] = {}
    for i, result in enumerate(results):
        rest = result[FINISH_KEY]
        staged, final = Path(rest["staged"]), cfg.slips_dir / result["slip"]
        if staged.parent != final.parent or not staged.name.startswith(f".{final.name}."):
            errors[i] = ValueError(f"refused: {staged.name} is not a slip staged for {result['slip']}")
            continue
        try:
            slip.commit_slip(staged, final, folder=False)  # (a file system that allocates late says ENOSPC at the sync)
        except Exception as e:  # noqa: BLE001 - this slip's error, told with it
            errors[i] = _commit_error(cfg, conn, rest, e)
            continue
        placed.setdefault(final.parent, []).append(i)
    for folder, put in placed.items():
        try:
            slip.sync_folder(folder)
        except Exception as e:  # noqa: BLE001 - every slip renamed into it is not durable
            for i in put:
                errors[i] = _commit_error(cfg, conn, results[i][FINISH_KEY], e)
    return errors


def _commit_error(cfg: config_mod.Config, conn, rest: dict[str, Any], e: Exception) -> BaseException:
    """The error a slip's failed commit is told with: StoreFull when the store is full,
    StoreUnwritable when it cannot be written (a failing disk says EIO at the sync: the
    data never reached it), else ``e`` itself."""
    if not isinstance(e, OSError):
        return e
    holds = int(rest.get("store_full_holds") or 0)
    told = _store_full(cfg, e, holds) if policy.is_store_full(e) else _store_fault(cfg, conn, e, holds)
    if told is None:
        return e
    told.__cause__ = e
    return told


def finished_render(result: dict[str, Any]) -> dict[str, Any]:
    """A render's result as render_slip returns it, without what was left to finish."""
    return {k: v for k, v in result.items() if k != FINISH_KEY}


def enqueue_email_in(pipe, conn, cfg: config_mod.Config, payload: dict[str, Any]) -> tuple[str, dict] | None:
    """enqueue_email's one script, queued on ``pipe`` (inside a batch's transaction, after
    its slips are durable) instead of sent on its own. Returns (send job id, the event's
    fields) for events.log_emitted once the transaction ran; None when this RQ's enqueue
    cannot be repeated by payrun.bulk (then enqueue_email, on its own, after it)."""
    enq = _email_enqueuer(conn, cfg)
    if enq is None:
        return None
    job_id, meta, fields, description = _send_job(cfg, payload)
    enq.enqueue(job_id, payload, description, meta, events.event(job_id, "queued", **fields), client=pipe)
    return job_id, fields


def _send_job(cfg: config_mod.Config, payload: dict[str, Any]) -> tuple[str, dict, dict, str]:
    """A slip's send job: its id, meta, the ledger event's fields, its description."""
    job_id = keys.email_job_id(payload["month"], payload["employee_id"])
    meta = {"kind": "email", "key": payload["key"], "retry": vars(cfg.email.retry)}
    # ``to``: the ledger keeps the address the send is made with (the job's copy is gone from
    # Redis a day after it finishes); events are not logged with it (jobs.events._log_event)
    fields = dict(kind="email", company=payload["company_id"], employee=payload["employee_id"],
                  month=payload["month"], key=payload["key"], queue=keys.EMAIL_QUEUE, to=payload.get("to"))
    return job_id, meta, fields, f"send slip {payload['key']}"


_transport_lock = threading.Lock()
_transports: dict[tuple[str, float], Any] = {}


def transport():
    from jobs import mail
    from payrun.provider import email_token

    cfg = settings()
    k = (cfg.email_url, float(cfg.email.timeout_s))
    with _transport_lock:
        if k not in _transports:
            # no email URL: the local provider of this data directory, which wants its token
            # (the sender: an SMTP credentials probe offers it, as a send does: jobs.senders)
            _transports[k] = mail.transport_for(cfg.email_url, timeout_s=cfg.email.timeout_s, token=email_token(cfg),
                                                sender=cfg.email.sender)
        return _transports[k]


_limiters: dict[int, Any] = {}
_limiter_lock = threading.Lock()


def limiter(conn):
    """The global email limits seen through ``conn``: one Limiter per connection."""
    from jobs.limits import email_limiter

    return _per_connection(_limiters, _limiter_lock, conn, None, lambda: email_limiter(conn, settings()))


def send_limited(conn, cfg: config_mod.Config, msg, key: str, token: str, started: float | None = None,
                 job_timeout_s: float | None = None) -> str:
    """Send ``msg`` under the global limits, for the attempt holding the idempotency claim
    (``key``, ``token``): body and connection ready first, then the start time, then the
    send (re-gated if this thread stalled after its start). A failure gives the claim
    back, a provider 429 pauses every sender, and so does a provider failing
    ``limits.outage_after`` sends in a row (ProviderDown: no attempt spent); success
    marks the key sent. Just before the message is written (over SMTP again just before
    DATA), the claim is checked still ours and renewed (jobs.idempotency.hold), or the
    send stops unsent (ClaimLost). A made send whose record finds Redis away (restarting)
    is recorded once it is back, until shortly before its job's end: see ``_record_sent``.
    The job started at ``started`` (monotonic; default now) with its own ``job_timeout_s``
    (default the configured send timeout): the wait and the send end within it
    (jobs.policy.send_window). Returns the provider's message id."""
    if started is None:
        started = time.monotonic()
    job_ends = job_end(started, job_timeout_s, cfg.email.timeout_s)
    record_by = job_ends - RECORD_MARGIN_S
    send_s = send_timeout_s(cfg.email.timeout_s, job_timeout_s)
    lim = limiter(conn)
    claim_ttl = send_claim_ttl_s(cfg.email.timeout_s, cfg.lease.visibility_s)
    sent = False  # the request was handed to the transport: its failure is the provider's
    try:
        tr = transport()
        if senders.HOST.paused:  # (a lane took it as this process paused: it goes to another one)
            raise RefusedHere(f"not sent: {senders.HOST.why()}; back for another send-email process, "
                              "no attempt spent")
        prepared = tr.prepare(msg)  # before the wait: at the start time, only the send is left
        deadline, send_until = send_window(time.monotonic(), send_s, job_ends)
        if deadline <= time.monotonic() or not lim.token(deadline_s=deadline):  # (too late in its job: no start)
            _raise_if_provider_down(conn)
            raise RateWait()
        written: list[float] = []
        traced: list[tuple[float, float]] = []  # PAYRUN_LOG_DEBUG=payrun.sends: logged once sent, not on the way
        tracing = sends_log.isEnabledFor(logging.DEBUG)

        def still_ours() -> None:
            if not idempotency.hold(conn, key, token, claim_ttl):
                raise ClaimLost(f"not sent: the claim on {key} ran out while this attempt waited "
                                "(stalled past it); another attempt may hold it or have sent it")

        def before_write() -> bool:
            ok = lim.recheck(deadline_s=deadline)  # (may wait for a new start: the claim check comes after)
            ok = ok and send_may_start(time.monotonic(), send_until, send_s)  # (stalled since its start: too late)
            if ok:
                still_ours()
            written.append(time.monotonic())
            if tracing:
                traced.append((lim.last_gate_stamp_ms() or 0.0, time.time() * 1000))
            return ok

        try:
            sent = True
            message_id = tr.send(msg, prepared, before_write=before_write, before_data=still_ours,
                                 until=send_until)
        finally:
            for stamp_ms, wall_ms in traced:
                sends_log.debug("send %s: gate %.3f written %.3f", key, stamp_ms, wall_ms)
    except Throttled as e:  # a 429: every sender on every host waits, not just us
        idempotency.release(conn, key, token)
        if pauses_every_sender(e):
            _log_provider_429(key, lim.last_gate_pass_s(), written)
            if cfg.limits.pause_on_429:
                lim.pause(e.retry_after_s)
        raise
    except BaseException as e:
        idempotency.release(conn, key, token)
        if sent and isinstance(e, AccountRefused):
            _refused_here(conn, tr, key, e)  # only this process refused: RefusedHere
        if sent and counts_as_provider_failure(e):
            _count_provider_failure(lim, key, e)
        raise
    senders.HOST.sent()
    if getattr(message_id, "duplicate", False):
        # delivered once, by an attempt whose outcome we lost (its process was killed, or
        # the reply never came): the provider deduped this one. Say so, and count it
        log.warning("send %s: the provider already had this slip (accepted from an earlier attempt "
                    "whose reply was lost): not delivered again", key)
        lim.count_duplicate()
    ended = _record_sent(conn, key, token, message_id, lim, record_by)
    if ended:
        pauses, for_s = ended
        log.warning("email provider answering again: sends resume (its first failure %.0f s ago, %d pause%s)",
                    for_s, pauses, "" if pauses == 1 else "s")
    return message_id


_RECORDING: dict[str, tuple[Any, str, str, str, Any]] = {}
"""Made sends waiting for Redis to record them, by job id: (conn, key, token, message_id,
outage keys). A worker stopped by force hands its lanes' jobs back; for one of these it
first records the send (record_pending), or the next try would send the slip again."""
_RECORDING_LOCK = threading.Lock()


def record_pending(job_id: str) -> bool | None:
    """Record the made send of ``job_id`` if one waits (one try, no waiting): True when
    recorded, False when Redis still did not answer, None when there is none."""
    with _RECORDING_LOCK:
        pending = _RECORDING.get(job_id)
    if pending is None:
        return None
    conn, key, token, message_id, outage_keys = pending
    try:
        idempotency.mark_sent(conn, key, token, message_id, outage_keys=outage_keys)
    except Exception:  # noqa: BLE001 - Redis still away: the caller must not free the claim
        return False
    return True


RECORD_SOCKET_TIMEOUT_S = 5.0
"""How long a made send's record waits for Redis's reply before it counts Redis as away
(and notes the delivery on the host, jobs.unrecorded). A lane's own client waits as long
as a send may take (30 s), so a Redis that hung (stopped, a network partition) held the
record until the job's timeout cut it off, before any note was written: 25 of 1,200
slips were sent twice in a multi-host drill (Redis stopped for 35 s, then killed)."""

_RECORD_CLIENTS: dict[tuple[int, float], tuple[Any, Any]] = {}
_RECORD_CLIENTS_LOCK = threading.Lock()


def record_client(conn):
    """A client on ``conn``'s server whose replies time out after RECORD_SOCKET_TIMEOUT_S
    (one pool per process and pool, kept); ``conn`` itself if its timeout is as short."""
    import redis

    pool = getattr(conn, "connection_pool", None)
    if not isinstance(conn, redis.Redis) or pool is None:
        return conn
    timeout = RECORD_SOCKET_TIMEOUT_S
    current = pool.connection_kwargs.get("socket_timeout")
    if current is not None and current <= timeout:
        return conn
    with _RECORD_CLIENTS_LOCK:
        kept = _RECORD_CLIENTS.get((id(pool), timeout))
        if kept is None or kept[0] is not pool:
            client = redis.Redis(connection_pool=pool.__class__(
                connection_class=pool.connection_class, **{**pool.connection_kwargs, "socket_timeout": timeout}))
            kept = _RECORD_CLIENTS[(id(pool), timeout)] = (pool, client)
    return kept[1]


def _record_sent(conn, key: str, token: str, message_id: str, lim, record_by: float,
                 clock=time.monotonic, pause=time.sleep):
    """Record the key sent (jobs.idempotency.mark_sent). The provider has accepted the
    message: if Redis does not answer (restarting, loading its data), the record waits for
    it (jobs.policy.record_retry_wait_s) until ``record_by`` rather than fail the job,
    whose next try would send the slip a second time. Past ``record_by`` the Redis error
    goes up as before."""
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import ResponseError as RedisResponseError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    tries = 0
    first_error_at = None
    noted = ""
    conn = record_client(conn)  # (a hung Redis: noted within seconds, not cut off by the job's timeout)
    try:
        while True:
            try:
                ended = idempotency.mark_sent(conn, key, token, message_id, outage_keys=lim.outage_keys())
            except (RedisConnectionError, RedisTimeoutError, RedisResponseError) as e:
                if isinstance(e, RedisResponseError) and not redis_refuses_writes(e):
                    raise  # (a refusal to write, a full disk under its AOF, waits like an absence)
                tries += 1
                wait = record_retry_wait_s(tries, record_by - clock())
                if first_error_at is None:
                    noted = _note_unrecorded(key, message_id)
                if wait is None:
                    log.error("send %s: delivered, but Redis did not answer to record it (%s): %s (the HTTP "
                              "provider dedupes a second send; over SMTP it is a second email)",
                              key, events.one_line(e, 200), noted)
                    raise
                if first_error_at is None:
                    first_error_at = clock()
                    log.warning("send %s: delivered; Redis does not answer (%s): recording it once Redis is back",
                                key, events.one_line(e, 200))
                    with _RECORDING_LOCK:  # for a stop by force meanwhile (record_pending)
                        _RECORDING[_job_of(token)] = (conn, key, token, message_id, lim.outage_keys())
                pause(wait)
                continue
            if first_error_at is not None:
                log.warning("send %s: recorded as sent after waiting %.1f s for Redis", key, clock() - first_error_at)
                try:
                    unrecorded.forget(settings().home, key)  # (recorded: the note is done)
                except OSError:
                    pass  # a stale note only makes a later try record what is recorded already
            return ended
    finally:
        if first_error_at is not None:
            _forget_recording(token)


def _note_unrecorded(key: str, message_id: str) -> str:
    """Note a delivery Redis cannot record (yet), at its first failed record: a give-up, a
    forced stop or a crash while waiting then all leave it (jobs.unrecorded). Returns what
    the log says of it."""
    try:
        unrecorded.remember(settings().home, key, message_id)
    except OSError as e:  # (a full disk, say)
        return f"no note could be kept ({e}): the job's next try sends it again"
    return ("noted on this host (jobs.unrecorded): its send-email process records it once Redis answers, and "
            "no host sends it again after that; a try on another host before it still would")


def record_noted(conn, home) -> int:
    """Record in Redis every delivery this host noted while Redis could not record it
    (jobs.unrecorded.record_all): then a next try on any host finds its key sent and sends
    nothing. The send-email process calls it at its start and every
    NOTES_RECORD_EVERY_S while notes are kept. Returns how many were recorded; a Redis
    still away leaves them for the next call (logged at most once a minute)."""
    import socket

    owner = f"noted on {socket.gethostname()}"
    recorded: list[str] = []

    def mark(key: str, message_id: str) -> None:
        if idempotency.mark_noted(conn, key, message_id, owner):
            recorded.append(key)

    try:
        n, error = unrecorded.record_all(home, mark)
    except OSError as e:  # the notes unreadable (a failing disk): the next call tries again
        n, error = 0, e
    if recorded:
        log.warning("recorded %d deliver%s noted while Redis could not record %s (%s%s): their next tries, on "
                    "any host, send nothing", len(recorded), "y" if len(recorded) == 1 else "ies",
                    "it" if len(recorded) == 1 else "them", ", ".join(recorded[:3]), " …" if len(recorded) > 3 else "")
    if error is not None and time.monotonic() - _NOTES_WARNED[0] >= 60:
        _NOTES_WARNED[0] = time.monotonic()
        log.warning("deliveries noted in %s are not recorded yet, Redis does not answer (%s): trying again "
                    "every %g s", unrecorded.FILE, events.one_line(error, 200), NOTES_RECORD_EVERY_S)
    return n


NOTES_RECORD_EVERY_S = 5.0
_NOTES_WARNED = [-1e9]


def delivered_earlier(conn, cfg: config_mod.Config, key: str, token: str) -> str | None:
    """For a try that holds ``key``'s claim, before it sends: the message id an earlier try
    delivered as while Redis could not record it (this host's note, jobs.unrecorded), now
    recorded under this try's claim, and the note dropped. None: nothing noted, send."""
    earlier = unrecorded.find(cfg.home, key)
    if earlier is None:
        return None
    idempotency.mark_sent(conn, key, token, earlier)
    unrecorded.forget(cfg.home, key)
    log.warning("send %s: delivered at an earlier try (message %s) while Redis could not record it: "
                "recorded now, not sent again", key, earlier)
    return earlier


def _job_of(token: str) -> str:
    """The job id of an attempt's claim token (``<job id>:<attempt>``)."""
    return token.rsplit(":", 1)[0]


def _forget_recording(token: str) -> None:
    with _RECORDING_LOCK:
        _RECORDING.pop(_job_of(token), None)


def _count_provider_failure(lim, key: str, e: BaseException) -> None:
    """The provider failed this send. Raises ProviderDown (no attempt spent) if that makes
    ``limits.outage_after`` failures in a row, or came back during the outage pause;
    otherwise returns, and the job retries as usual."""
    try:
        down = lim.provider_failed(f"{type(e).__name__}: {events.one_line(e, 200)}",
                                   started_ms=lim.last_gate_stamp_ms() or 0, asked_s=getattr(e, "retry_after_s", None))
    except Exception:  # Redis unreachable: the send's own error says more
        log.warning("could not count a provider failure of %s", key, exc_info=True)
        return
    if down is None:
        return
    if down.started:
        log.error("email provider down: %d sends in a row failed (last: %s); every sender pauses %.0f s "
                  "(pause %d), then one send probes it", down.streak, events.one_line(e, 200), down.wait_s, down.trips)
    raise ProviderDown(f"email provider down ({down.streak} sends in a row failed), every sender paused "
                       f"{down.wait_s:.0f} s, no attempt spent; last error: {e}", retry_after_s=down.wait_s) from e


def _refused_here(conn, tr, key: str, e: BaseException) -> None:
    """The provider refused this process's credentials. Raises RefusedHere (no attempt
    spent, nobody else pauses, this process pauses itself: jobs.senders) when another
    send-email process is alive and not refused; returns otherwise (every process refused,
    or this one alone: a provider outage, counted as before)."""
    where = getattr(tr, "credentials_source", lambda: "the email credentials")()
    if senders.HOST.refused(conn, where, events.one_line(e, 200)):
        raise RefusedHere(f"not sent: the provider refused this send-email process's credentials ({where}) while "
                          f"others send: back for another process, no attempt spent; {e}") from e


def _raise_if_provider_down(conn) -> None:
    """A send that gave up waiting for a start because of an outage pause says so (and
    spends no attempt either way)."""
    from jobs.limits import read_outage

    try:
        out = read_outage(conn)
    except Exception:
        return
    if out and out["pauses"]:
        raise ProviderDown(f"email provider down for {out['for_s']:.0f} s ({out['failed_in_a_row']} sends in a "
                           f"row failed), not sent, no attempt spent; last error: {out['last_error']}",
                           retry_after_s=max(1.0, out["paused_for_s"]))


def _log_provider_429(key: str, passed_s: float | None, written: list[float]) -> None:
    """When did the refused request pass our send gate and leave? (A 429 under the gate
    means it reached the provider later than its recorded start: the line says by how
    much on our side; the provider's throttle record has its side.)"""
    now = time.monotonic()
    if passed_s is None or not written:
        log.warning("provider 429 for %s (not written after a gate pass)", key)
        return
    log.warning("provider 429 for %s: written %.1f ms after its gate pass, answered %.1f ms after the write",
                key, (written[-1] - passed_s) * 1000, (now - written[-1]) * 1000)


def _slip_path(slips_dir: Path, slip: Any) -> Path | None:
    """``slips_dir / slip`` if it stays inside the slip store once resolved (symlinks
    followed), else None: the path comes from a job in Redis, and a send attaches what it
    reads there to an email."""
    if not isinstance(slip, str) or not slip or "\x00" in slip:
        return None
    root = Path(slips_dir).resolve()
    path = (root / slip).resolve()
    return path if path.is_relative_to(root) and path != root else None


RENDERED_AGAIN_FOR = "rendered_again_for"
"""In a render job's meta: the send a `payrun retry` renders its slip again for."""
RENDER_WAITS = "render_waits"
"""In a send job's meta: [looks so far, when it first looked] while its slip is being
rendered again (jobs.policy.render_wait_s)."""

_RENDERING = ("queued", "started", "scheduled", "deferred")


def _slip_store_full() -> bool:
    """Whether this host's slip store has no room for a slip (jobs.policy.STORE_ROOM_MIN_BYTES;
    one statvfs; False when it cannot be told)."""
    from payrun.diskspace import free_bytes

    free = free_bytes(settings().slips_dir)
    return free is not None and free < policy.STORE_ROOM_MIN_BYTES


def _slip_store_unwritable(conn) -> bool:
    """Whether a host's render workers find the slip store cannot be written (a live entry
    in keys.SLIP_STORE_FAULTS: payrun.slipstore.report_fault); False when Redis does not say."""
    try:
        return bool(slipstore.read_faults(conn))
    except Exception:  # noqa: BLE001
        return False


def render_job_of(payload: dict[str, Any]) -> str:
    """The id of the render job that makes a send's slip: the pay run's render, or a
    resend's (``payrun resend``, key ``slip:<month>:<employee>:resend-<n>``)."""
    from jobs import oneoff

    month, emp = payload["month"], payload["employee_id"]
    if ":resend-" in payload["key"]:
        return oneoff.resend_render_job_id(month, emp, oneoff.resend_number(payload["key"]))
    return keys.render_job_id(month, emp)


def slip_missing(conn, payload: dict[str, Any], meta: dict[str, Any] | None = None,
                 now: float | None = None) -> Exception:
    """What a send whose slip file is not in this host's slip store raises: RenderPending (no
    attempt spent: it looks again after jobs.policy.render_wait_s, counted in ``meta``, the
    send's) while the slip's render is queued or running (a `payrun retry` of this send put
    it there), else SlipMissing (failed at once; `payrun retry` renders the slip again
    first), also once it has waited an hour for a render that does not run (not while the
    slip store is full: the render waits for room, and the send with it)."""
    import socket

    from jobs.policy import RENDER_WAIT_MAX_S, render_wait_s

    render_id = render_job_of(payload)
    raw_status, raw_meta = conn.hmget(f"rq:job:{render_id}", "status", "meta")
    status = raw_status.decode() if isinstance(raw_status, bytes) else raw_status
    meta = meta if meta is not None else {}
    if status in _RENDERING:
        now = time.time() if now is None else now
        waits, since = meta.get(RENDER_WAITS) or (0, now)
        wait_s = render_wait_s(int(waits), now - float(since))
        why = "waiting for it"
        if wait_s is None and _slip_store_full():
            # its render waits for room (held, or left in its queue: jobs.errors.StoreFull), spending
            # no attempt, for as long as the store is full: so does the send, instead of failing
            # for good an hour in, blaming the render workers
            wait_s, why = RENDER_WAIT_MAX_S, "waiting for it, as it waits for room in the full slip store"
        elif wait_s is None and _slip_store_unwritable(conn):  # (read-only, a failing disk: held alike)
            wait_s, why = RENDER_WAIT_MAX_S, "waiting for it, as it waits for a slip store that cannot be written"
        if wait_s is not None:
            meta[RENDER_WAITS] = [int(waits) + 1, since]
            return RenderPending(f"slip {payload['slip']} is being rendered again ({render_id} {status}): {why}",
                                 retry_after_s=wait_s)
        meta.pop(RENDER_WAITS, None)
        return SlipMissing(f"slip file {payload['slip']} is missing from the slip store; its render {render_id} has "
                           f"been {status} for over {int((now - float(since)) // 60)} min: is a pdf-render worker up, "
                           "and pdf-render not drained? Then `payrun retry` this send")
    meta.pop(RENDER_WAITS, None)
    try:
        again = status == "finished" and bool(json.loads(raw_meta or b"{}").get(RENDERED_AGAIN_FOR))
    except (ValueError, AttributeError):
        again = False
    if status == "failed":
        why = (f"its render {render_id} failed (`payrun job {render_id}` says why): fix that, then `payrun retry` "
               "this send (it renders the slip again)")
    elif again:  # rendered again for a retry of this send, and still not here
        why = (f"it was rendered again ({render_id}) and is still not here: deleted again, or this host "
               f"({socket.gethostname()}) reads another slip store than the render hosts (check PAYRUN_SLIPS_DIR and "
               "its mount); then `payrun retry` (it renders the slip again)")
    else:
        why = "deleted, or a store not mounted here: `payrun retry` renders it again"
    return SlipMissing(f"slip file {payload['slip']} is missing from the slip store; {why}")


def send_slip(payload: dict[str, Any]) -> dict[str, Any]:
    from jobs import mail

    cfg = settings()
    job = get_current_job()
    started = time.monotonic()  # (its timeout runs from ~now)
    conn = job.connection
    key = payload["key"]
    token = f"{job.id}:{job.meta.get('attempt', 0)}"
    state = idempotency.claim(conn, key, token, send_claim_ttl_s(cfg.email.timeout_s, cfg.lease.visibility_s))
    if state == idempotency.SENT:
        unrecorded.forget(cfg.home, key)  # (recorded since by another try: a note of it is done)
        return {"skipped": "already sent", "key": key}
    if state == idempotency.BUSY:
        # not a failure of ours: wait out the other attempt's claim, spending no attempt
        left_ms = conn.pttl(keys.idem_state(key))
        raise Throttled(f"another attempt is sending {key} right now",
                        retry_after_s=max(1.0, left_ms / 1000) if left_ms and left_ms > 0 else 1.0)
    if (earlier := delivered_earlier(conn, cfg, key, token)) is not None:
        return {"sent": key, "message_id": earlier, "recorded_late": True}
    path = _slip_path(cfg.slips_dir, payload["slip"])
    if path is None:
        idempotency.release(conn, key, token)
        raise PermanentError("slip path refused: it is not a file inside the slip store")

    # looked at as the render wrote it (its folders under the store, symlinks not followed),
    # not as resolved: a symlinked folder is refused here as it is there
    as_written = cfg.slips_dir / payload["slip"]

    def read_slip() -> bytes:
        """The slip's bytes, only from a file and folders that are this account's alone."""
        if why := slipstore.unsafe(cfg.slips_dir, as_written, slip=True):
            raise StoreUnsafe(why)
        return path.read_bytes()

    try:
        try:
            pdf = read_slip()
        except FileNotFoundError:
            missing = slip_missing(conn, payload, job.meta)
            try:  # a render that finished between that read and this look: read once more
                pdf = read_slip() if isinstance(missing, SlipMissing) else None
            except FileNotFoundError:
                pdf = None
            if pdf is None:
                raise missing from None
    except BaseException:  # (refused, missing, pending, or an I/O error): the next try may send at once
        idempotency.release(conn, key, token)
        raise
    job.meta.pop(RENDER_WAITS, None)
    subject, text_body, attachment_name = slip_email(payload)
    msg = mail.Message(
        to_addr=payload["to"],
        to_name=payload["to_name"],
        subject=subject,
        text_body=text_body,
        attachment_name=attachment_name,
        attachment_bytes=pdf,
        idempotency_key=key,
        sender=cfg.email.sender,
    )
    message_id = send_limited(conn, cfg, msg, key, token, started=started, job_timeout_s=job.timeout)
    return {"sent": key, "message_id": message_id}


def slip_email(payload: dict[str, Any]) -> tuple[str, str, str]:
    """A slip's email from its send's payload (``email_payload``): subject, text body and the
    PDF's file name. A resend says it is re-issued (or corrected) and what it replaces; a
    leaver's slip of the month they left in (``final``) says it is their final one, in the
    subject, the body's first line and the file name (``salary-slip-2026-11-emp-1-final.pdf``;
    a resend of it ``…-final-corrected.pdf`` / ``…-final-reissued.pdf``), as the slip does. Names and dates only: no figure
    of the slip is in it. Pure."""
    month = payload["month"]
    again = payload.get("reissued")  # HR's resend: say it replaces the slip sent before
    corrected = bool(again and payload.get("corrected"))
    final = policy.final_day(month, payload.get("final"))
    company = payload["company_name"]
    subject = (("Corrected: " if corrected else "Re-issued: " if again else "")
               + f"Your {'final ' if final else ''}salary slip for {month_label(month)} — {company}")
    text_body = (
        f"Dear {payload['to_name']},\n\nPlease find attached your " + ("corrected " if corrected else "")
        + ("final " if final else "") + f"salary slip for {month_label(month)}"
        + (f", your last month with {company} (you left on {final})." if final else ".")
        + (" " + reissue_sentence(month_label(month), again, payload.get("replaces"), corrected) if again else "")
        + f"\n\n{company} payroll\n"
    )
    attachment_name = (f"salary-slip-{month}-{payload['employee_id']}" + ("-final" if final else "")
                       + ("-corrected" if corrected else "-reissued" if again else "") + ".pdf")
    return subject, text_body, attachment_name


def noop(*args: Any, **kwargs: Any) -> None:
    """A job that does nothing (benchmarks of the runtime's own overhead)."""
    return None


def reissue_sentence(month: str, reissued: str, replaces: str | None, corrected: bool) -> str:
    """What a resend's email says of the slip it replaces (``month`` as the slip prints it)."""
    if corrected and replaces:
        return (f"It was corrected on {reissued} and replaces the slip for {month} sent to you on {replaces}: "
                "its figures are the corrected ones.")
    if replaces:
        return f"It was re-issued on {reissued} and replaces the slip for {month} sent to you on {replaces}."
    return f"It was re-issued on {reissued} and replaces any slip for {month} you received before."


def month_label(month: str) -> str:
    """2026-11 -> November 2026 (jobs.slip has the same, but importing it loads WeasyPrint)."""
    import calendar

    year, mon = month.split("-")
    return f"{calendar.month_name[int(mon)]} {year}"
