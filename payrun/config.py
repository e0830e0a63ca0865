"""Configuration: one TOML file plus environment variables, validated at start.

Precedence (highest first): environment variables, the TOML file named by
``PAYRUN_CONFIG`` (or ``--config``), then the defaults below. Every default is a
number from the source story (seed): 0.8 s render, 1.2 s send, 40 emails/s, backoff
1 s / 300 s / 6 attempts, job timeout 30 s < lease 60 s, grace 30 s; except the sends in
flight: 50, not the seed's 45 (see LimitsConfig.email_concurrency).

Environment variables honoured by every command:
  PAYRUN_HOME        data directory (ledger, payroll db, slips, embedded Redis, logs); ./var
  PAYRUN_CONFIG      the TOML file
  PAYRUN_REDIS_URL   an external Redis; unset = the embedded server under PAYRUN_HOME
  PAYRUN_EMAIL_URL   smtp://… or http://…; unset = the local provider (payrun provider)
  PAYRUN_SLIPS_DIR   the slip store, shared by render and send hosts; $PAYRUN_HOME/slips
  PAYRUN_BANK_TOKEN  bearer token for scheduler.bank_url; unset = the local simulator's
"""

from __future__ import annotations

import re

import dataclasses
import ipaddress
import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from payrun.errors import ConfigError
from payrun.text import header_safe


def _redacted_repr(self) -> str:
    """A settings section's repr with its URLs' passwords and its tokens as ***: the
    dataclass's own printed them, and Textual's crash screen prints every frame's locals
    (a ``cfg`` among them)."""
    shown = []
    for f in dataclasses.fields(self):
        value = getattr(self, f.name)
        if f.name.endswith("url") and isinstance(value, str):
            value = redact_url(value)
        elif f.name.endswith("token") and value:
            value = "***"
        shown.append(f"{f.name}={value!r}")
    return f"{type(self).__name__}({', '.join(shown)})"


@dataclass
class RetryPolicy:
    base_s: float = 1.0
    """First backoff ceiling; attempt n waits random(0, min(cap, base * 2**n))."""
    cap_s: float = 300.0
    """Largest backoff ceiling."""
    attempts: int = 6
    """Total tries, the first included. 1 = never retry."""
    jitter: bool = True
    """Full jitter. false = every job waits the same ceiling (only to demonstrate a herd)."""


@dataclass
class RenderConfig:
    workers: int = 0
    """pdf-render worker processes per host; 0 = one per core."""
    timeout_s: int = 30
    """A render running longer is killed (even inside C code) and retried."""
    jobs_per_horse: int = 1000
    """Renders one forked, warm work horse serves before it is replaced (it is replaced at
    once when killed: timeout, grace, crash). 1 = fork per job, RQ's way: each fork
    re-copies the pages a render touches, ~40 ms of CPU on a ~65 ms render (bench/render.py).
    1000 rather than 100 (session 46): a new horse's fork and its first renders' copies
    cost ~1-2 % of the pool's CPU at 100 (bench/ab_render.py: 2.6 % more slips/s at 1000),
    while a horse's memory grows ~9 KB a render (73 MiB at 100 renders, 81 MiB at 1000)."""
    batch: int = 16
    """Render jobs a worker takes and starts at once (the next batch while the last of one
    renders), finished half a batch at a time (their slips durable, then their sends and
    successes in one transaction): fewer round trips per slip. 1 = one at a time."""
    retry: RetryPolicy = field(default_factory=RetryPolicy)


@dataclass
class EmailConfig:
    url: str = ""
    """smtp://user:pass@host:port[?starttls=1] or http://host:port; '' = local provider."""
    sender: str = "Payroll <payroll@payrun.localhost>"
    lanes: int = 50
    """Concurrent sends per send-email worker process (threads, not processes); the global
    cap (limits.email_concurrency) bounds them across every process and host."""
    timeout_s: int = 30
    """One send (connect + request + reply) longer than this counts as failed."""
    retry: RetryPolicy = field(default_factory=RetryPolicy)

    __repr__ = _redacted_repr


@dataclass
class LimitsConfig:
    email_concurrency: int = 50
    """Sends in flight across every host. The seed's arithmetic: 40/s x 1.2 s = 48 in
    flight saturate the provider; the seed chose 45 to leave headroom against 429s, which
    caps sending at 37.5/s (0.94 of the limit). Here the rate limiter and its send gate
    keep the provider's limit, so the cap only has to exceed 48 plus the per-send overhead:
    50 (bench/email.py: 0.977 of the limit, 0 429s)."""
    email_rate_per_s: float = 40.0
    """The provider's limit: sends started per second across every host."""
    db_concurrency: int = 60
    """Ledger/DB connections workers may hold at once (seed: 60 of 200)."""
    pause_on_429: bool = True
    """A 429's Retry-After pauses every sender on every host. false = only the job that got
    it waits (the chaos suite turns it off to show what the retry policy alone does)."""
    outage_after: int = 10
    """A provider outage: when this many sends in a row, across every host, fail with a
    5xx, a connection refused or dropped or a timeout, every sender pauses
    (outage_pause_s), then one send at a time probes the provider until one succeeds.
    Sends refused while it is down spend no attempt, so an outage longer than the retry
    policy's ~30 s sends nothing to the failed list. 0 = off: each job retries on its own
    and gives up after its attempts."""
    outage_pause_s: float = 5.0
    """The first pause of an outage; each failed probe doubles it."""
    outage_pause_max_s: float = 30.0
    """The longest pause: a provider back from an outage gets its next request within this."""


@dataclass
class LeaseConfig:
    visibility_s: int = 60
    """A job not heartbeated for this long is presumed lost and returned by the reaper."""
    grace_s: int = 30
    """On SIGTERM a worker finishes its jobs within this, else requeues them."""
    stuck_after_s: int = 600
    """A job running longer than this is reported as stuck (seed: 10 minutes)."""
    reap_every_s: int = 5
    """How often `payrun reap --loop` looks for jobs of dead workers (cheap: a few reads)."""


@dataclass
class ProviderConfig:
    host: str = "127.0.0.1"
    port: int = 8025
    latency_s: float = 1.2
    rate_per_s: float = 40.0


@dataclass
class RedisConfig:
    url: str = ""
    """redis://… or unix://…; '' = embedded server started by payrun under PAYRUN_HOME/redis."""
    readonly_url: str = ""
    """A read-only user's URL for `payrun console --readonly` on an external Redis."""

    __repr__ = _redacted_repr


@dataclass
class MetricsConfig:
    port: int = 9308


@dataclass
class SchedulerConfig:
    """Cron entries (written in `timezone`) and how ticks fire; see scheduler/cron.py."""
    entries: list = field(default_factory=lambda: [
        {"name": "payroll", "cron": "0 2 1 * *", "job": "payroll"},
        {"name": "bank-status", "cron": "*/15 * * * *", "job": "bank-status"},
        {"name": "reaper", "cron": "*/5 * * * *", "job": "reaper"},
    ])
    catchup_window_s: int = 21600
    """A tick missed while no scheduler ran fires once on return within this; later = recorded as missed."""
    poll_s: float = 1.0
    """How often each scheduler process looks for due ticks."""
    lock_ttl_s: int = 900
    """TTL of a tick's Redis lock (the pay run's lock:payroll:<month> is always 900 s)."""
    tick_timeout_s: int = 600
    """Job timeout of a tick on the control queue (the 50,000-slip fan-out takes about a minute)."""
    bank_url: str = "http://127.0.0.1:8026"
    """The payroll bank's salary-credit API (`payrun bank` serves a local simulation)."""
    bank_token: str = ""
    """Bearer token for the bank's API (PAYRUN_BANK_TOKEN); empty = for a bank on this
    host's loopback, the data directory's own secret, which `payrun bank` requires."""

    __repr__ = _redacted_repr
    """Prometheus endpoint of `payrun ledger`, on 127.0.0.1 only; -1 = off, 0 = any free port."""


@dataclass
class Config:
    home: Path = Path("var")
    slips: str = ""
    """The slip store; '' = $PAYRUN_HOME/slips. Hosts that render and hosts that send must
    see the same store (one machine, or a shared mount). Env: PAYRUN_SLIPS_DIR."""
    timezone: str = "Asia/Dhaka"
    redis: RedisConfig = field(default_factory=RedisConfig)
    email: EmailConfig = field(default_factory=EmailConfig)
    render: RenderConfig = field(default_factory=RenderConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    lease: LeaseConfig = field(default_factory=LeaseConfig)
    provider: ProviderConfig = field(default_factory=ProviderConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    source: str = "defaults"
    """Where the values came from (for `payrun config show`)."""

    # ---- derived paths -------------------------------------------------
    @property
    def ledger_path(self) -> Path:
        return self.home / "ledger.db"

    @property
    def payroll_path(self) -> Path:
        return self.home / "payroll.db"

    @property
    def slips_dir(self) -> Path:
        return Path(self.slips).expanduser().absolute() if self.slips else self.home / "slips"

    @property
    def redis_dir(self) -> Path:
        return self.home / "redis"

    @property
    def log_dir(self) -> Path:
        return self.home / "log"

    @property
    def render_workers(self) -> int:
        return self.render.workers or (os.cpu_count() or 1)

    @property
    def email_url(self) -> str:
        return self.email.url or f"http://{self.provider.host}:{self.provider.port}"

    @property
    def embedded_redis(self) -> bool:
        return not self.redis.url

    def to_dict(self, redact: bool = True) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["home"] = str(self.home)
        d.pop("source")
        d["effective"] = {
            "email_url": self.email_url,
            "redis": "embedded" if self.embedded_redis else "external",
            "render_workers": self.render_workers,
            "ledger_path": str(self.ledger_path),
            "slips_dir": str(self.slips_dir),
            "source": self.source,
        }
        if redact:
            d["redis"]["url"] = redact_url(d["redis"]["url"])
            d["redis"]["readonly_url"] = redact_url(d["redis"]["readonly_url"])
            d["email"]["url"] = redact_url(d["email"]["url"])
            d["scheduler"]["bank_url"] = redact_url(d["scheduler"]["bank_url"])
            if d["scheduler"]["bank_token"]:
                d["scheduler"]["bank_token"] = "***"
            d["effective"]["email_url"] = redact_url(d["effective"]["email_url"])
        return d


SECRET_QUERY_PARAMS = frozenset({
    "password", "passwd", "pass", "pwd", "secret", "client_secret", "token", "access_token", "auth_token",
    "key", "api_key", "apikey", "api-key", "access_key", "secret_key",
})
"""Query parameters whose value a URL shown to anyone (``payrun config show``, an error
message, a log) replaces with ``***``, whatever their case (``?Token=``, ``?API_KEY=``): an
HTTP email provider's or a bank's URL may carry its credential so."""

_SECRET_PARAM_RE = re.compile(
    r"(?i)((?:^|(?<=[?&;#]))(?:" + "|".join(re.escape(n) for n in sorted(SECRET_QUERY_PARAMS, key=len, reverse=True))
    + r")=)[^&;#]*")
"""Such a parameter in text that is no readable URL (the fallback paths of redact_url)."""


def _secret_param(item: str) -> bool:
    name = unquote(item.split("=", 1)[0]).strip().lower()  # (api%5Fkey is api_key too)
    return "=" in item and name in SECRET_QUERY_PARAMS


def _mask_params(query: str) -> str:
    """``a=1&token=abc`` -> ``a=1&token=***``: the name as given, the value hidden."""
    return "&".join(q.split("=", 1)[0] + "=***" if _secret_param(q) else q for q in query.split("&") if q)


def redact_url(url: str) -> str:
    """Replace a password in a URL with ***, and the value of every query parameter that
    holds a credential (SECRET_QUERY_PARAMS, any case); keep everything else readable."""
    if not url:
        return url
    try:
        parts = urlsplit(url)
    except ValueError:  # unreadable (an unclosed IPv6 bracket): hide whatever could be a login
        head, sep, rest = url.partition("://")
        rest = _SECRET_PARAM_RE.sub(r"\1***", rest)
        return head + sep + ("***@" + rest.rsplit("@", 1)[1] if "@" in rest else rest)
    if "://" not in url:  # not a URL: show it as given, less anything before an @ and any password
        shown = _SECRET_PARAM_RE.sub(r"\1***", url)
        if shown.lower().startswith("mailto:") and ":" not in shown[7:].split("@", 1)[0]:
            return shown  # an email address, not a login: the operator's own text, shown
        return "***@" + shown.rsplit("@", 1)[1] if "@" in shown else shown
    netloc = parts.netloc
    if "@" in netloc:
        creds, host = netloc.rsplit("@", 1)
        user = creds.split(":", 1)[0]
        netloc = f"{user}:***@{host}" if ":" in creds else f"***@{host}"
    query = _mask_params(parts.query)
    out = f"{parts.scheme}://{netloc}{parts.path}"
    if query:
        out += f"?{query}"
    if parts.fragment:  # (#access_token=… as OAuth's implicit flow writes it)
        out += f"#{_mask_params(parts.fragment) if '=' in parts.fragment else parts.fragment}"
    return out


# ---- loading -------------------------------------------------------------

def _shown(value: Any) -> str:
    """A mistyped setting's value as an error names it: its type only. The settings most
    easily mistyped hold secrets (``redis = "redis://:PW@host"`` where a table belongs, a
    numeric ``bank_token``, a URL in a list), and that message reaches the terminal, cron mail
    and every supervised program's log at each restart."""
    kind = {dict: "table", list: "list", str: "string", int: "integer", float: "number", bool: "boolean"}.get(
        type(value), type(value).__name__)
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"


def _apply(obj: Any, data: dict[str, Any], where: str, problems: list[str] | None = None) -> None:
    """Set ``data``'s settings on ``obj``. Each unknown or mistyped one is a problem: added
    to ``problems`` (the rest still set, so that one reading reports every problem of the
    file), or raised as ConfigError at once without a list."""
    def problem(text: str) -> None:
        if problems is None:
            raise ConfigError(text)
        problems.append(text)

    known = {f.name: f for f in fields(obj) if f.name != "source"}
    for key, value in data.items():
        if key not in known:
            allowed = ", ".join(sorted(known))
            problem(f"unknown setting '{where}{key}' (allowed here: {allowed})")
            continue
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                problem(f"'{where}{key}' must be a table, got {_shown(value)}")
                continue
            _apply(current, value, f"{where}{key}.", problems)
            continue
        if isinstance(current, Path):
            value = Path(str(value))
        elif isinstance(current, bool) != isinstance(value, bool) or not isinstance(value, type(current)):
            if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            else:
                problem(f"'{where}{key}' must be {type(current).__name__}, got {_shown(value)}")
                continue
        setattr(obj, key, value)


def credentials_in(data: dict[str, Any]) -> list[str]:
    """The settings of a config file's parsed TOML that hold a credential (pure): a Redis or
    email URL with a password, a bank token. Such a file must be owner-only (``load``), as
    payrun's own secrets are: the Redis password reads every salary."""
    def section(name: str) -> dict[str, Any]:
        v = data.get(name)
        return v if isinstance(v, dict) else {}

    held = []
    for where, url in (("redis.url", section("redis").get("url")), ("redis.readonly_url", section("redis").get("readonly_url")),
                       ("email.url", section("email").get("url"))):
        if isinstance(url, str) and url:
            try:
                parts = urlsplit(url)
                has = bool(parts.password or parse_qs(parts.query).get("password"))
            except ValueError:  # unreadable (validate says so): count a login-like part
                has = "@" in url
            if has:
                held.append(where)
    if section("scheduler").get("bank_token"):
        held.append("scheduler.bank_token")
    return held


def load(path: str | os.PathLike | None = None, env: dict[str, str] | None = None) -> Config:
    """Build the effective configuration and validate it; raise ConfigError with a reason."""
    env = dict(os.environ if env is None else env)
    cfg = Config()
    path = path or env.get("PAYRUN_CONFIG")
    problems: list[str] = []
    if path:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
            data = tomllib.loads(text)
        except FileNotFoundError:
            raise ConfigError(f"config file {p} does not exist (from PAYRUN_CONFIG or --config)")
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}{toml_error_key(text, str(e))}")
        _apply(cfg, data, "", problems)
        if held := credentials_in(data):
            mode = p.stat().st_mode
            if mode & 0o006:  # (a group, e.g. root:payrun 0640, is the owner's deliberate choice)
                raise ConfigError(f"config file {p} holds credentials ({', '.join(held)}) and can be "
                                  f"{'read' if mode & 0o004 else 'changed'} by every user (mode {mode & 0o777:o}): "
                                  f"chmod o-rwx {p} (or 600), or move them into the environment")
        cfg.source = str(p)
    if env.get("PAYRUN_HOME"):
        cfg.home = Path(env["PAYRUN_HOME"])
    if env.get("PAYRUN_REDIS_URL"):
        cfg.redis.url = env["PAYRUN_REDIS_URL"]
    if env.get("PAYRUN_EMAIL_URL"):
        cfg.email.url = env["PAYRUN_EMAIL_URL"]
    if env.get("PAYRUN_SLIPS_DIR"):
        cfg.slips = env["PAYRUN_SLIPS_DIR"]
    if env.get("PAYRUN_BANK_TOKEN"):
        cfg.scheduler.bank_token = env["PAYRUN_BANK_TOKEN"]
    cfg.home = cfg.home.expanduser().absolute()
    if cfg.home in SYSTEM_DIRS:  # e.g. the default ./var, run from / : payrun would make /var 0700
        raise ConfigError(f"the data directory would be {cfg.home}, a system directory (the default ./var "
                          f"resolves against the current directory, {Path.cwd()}): set PAYRUN_HOME, or run "
                          f"payrun from its own directory")
    _check_home_is_a_directory(cfg.home)
    problems = problems + [f"{name} is not one line of printable ASCII (a line break, a control or a non-ASCII "
                           f"character): set the token alone" for name in ("PAYRUN_EMAIL_TOKEN", "PAYRUN_BANK_TOKEN")
                           if not header_safe(env.get(name) or "")]
    if not header_safe(cfg.scheduler.bank_token) and header_safe(env.get("PAYRUN_BANK_TOKEN") or ""):
        problems.append("scheduler.bank_token is not one line of printable ASCII: set the token alone")
    validate(cfg, email_token=bool(env.get("PAYRUN_EMAIL_TOKEN")), known=problems)
    return cfg



def _check_home_is_a_directory(home: Path) -> None:
    """A data directory that is a file (or under one) is said in one line: `payrun seed`
    showed a NotADirectoryError traceback for PAYRUN_HOME naming a file."""
    for p in (home, *home.parents):
        if p.exists() or p.is_symlink():
            if not p.is_dir():
                raise ConfigError(f"the data directory {home} cannot be made: {p} is a file, not a directory "
                                  f"(set PAYRUN_HOME to a directory)")
            return


def toml_error_key(text: str, error: str) -> str:
    """The setting on the line a TOML error names, as " (in 'key = ...')" (pure), or "".
    tomllib says only "Invalid value (at line 4, column 19)". The key, never the value: a
    half-typed line may hold a password."""
    m = re.search(r"at line (\d+)", error)
    lines = text.splitlines()
    if not m or not 1 <= int(m.group(1)) <= len(lines):
        return ""
    line = lines[int(m.group(1)) - 1]
    key = line.split("=", 1)[0].strip() if "=" in line else ""
    return f" (in '{key} = ...')" if key and len(key) <= 80 else ""


SYSTEM_DIRS = frozenset(Path(p) for p in ("/", "/var", "/usr", "/etc", "/tmp", "/root", "/home", "/opt", "/srv",
                                          "/bin", "/sbin", "/lib", "/boot", "/dev", "/proc", "/sys", "/run"))


def validate(cfg: Config, email_token: bool = False, known: list[str] | None = None) -> None:
    """Refuse settings that cannot work, naming the values involved: one ConfigError with
    every problem, after ``known`` ones (the file's unknown or mistyped settings), on one
    line. ``email_token``: PAYRUN_EMAIL_TOKEN is set (the provider's bearer token)."""
    problems: list[str] = []
    lease = cfg.lease
    for kind, timeout in (("render", cfg.render.timeout_s), ("email", cfg.email.timeout_s)):
        if timeout <= 0:
            problems.append(f"{kind}.timeout_s must be > 0 (got {timeout})")
        if timeout >= lease.visibility_s:
            problems.append(
                f"{kind}.timeout_s ({timeout} s) must be below lease.visibility_s "
                f"({lease.visibility_s} s): a job still running when its lease ends is given "
                f"to a second worker"
            )
        if lease.grace_s < timeout:
            problems.append(
                f"lease.grace_s ({lease.grace_s} s) must be at least {kind}.timeout_s "
                f"({timeout} s): otherwise a deploy cuts jobs that would have finished"
            )
    for kind, retry in (("render", cfg.render.retry), ("email", cfg.email.retry)):
        if retry.attempts < 1:
            problems.append(f"{kind}.retry.attempts must be >= 1 (got {retry.attempts})")
        if retry.base_s <= 0 or retry.cap_s < retry.base_s:
            problems.append(
                f"{kind}.retry needs 0 < base_s <= cap_s (got base_s={retry.base_s}, cap_s={retry.cap_s})"
            )
    if cfg.limits.email_concurrency < 1:
        problems.append(f"limits.email_concurrency must be >= 1 (got {cfg.limits.email_concurrency})")
    if cfg.limits.email_rate_per_s <= 0:
        problems.append(f"limits.email_rate_per_s must be > 0 (got {cfg.limits.email_rate_per_s})")
    if cfg.limits.outage_after < 0 or cfg.limits.outage_after == 1:
        problems.append(f"limits.outage_after must be 0 (off) or >= 2 sends in a row (got {cfg.limits.outage_after})")
    if not 0.1 <= cfg.limits.outage_pause_s <= cfg.limits.outage_pause_max_s <= 3600:
        problems.append(f"limits needs 0.1 <= outage_pause_s <= outage_pause_max_s <= 3600 (got outage_pause_s="
                        f"{cfg.limits.outage_pause_s}, outage_pause_max_s={cfg.limits.outage_pause_max_s})")
    if not 1 <= cfg.provider.port <= 65535:
        problems.append(f"provider.port must be a port number, 1-65535 (got {cfg.provider.port})")
    if why := provider_host_problem(cfg.provider.host):
        problems.append(f"provider.host {why}")
    if not -1 <= cfg.metrics.port <= 65535:
        problems.append(f"metrics.port must be -1 (off), 0 (any free port) or a port number (got {cfg.metrics.port})")
    if cfg.lease.reap_every_s < 1:
        problems.append(f"lease.reap_every_s must be >= 1 (got {cfg.lease.reap_every_s})")
    if cfg.email.lanes < 1:
        problems.append(f"email.lanes must be >= 1 (got {cfg.email.lanes})")
    if cfg.render.jobs_per_horse < 1:
        problems.append(f"render.jobs_per_horse must be >= 1 (got {cfg.render.jobs_per_horse})")
    if not 1 <= cfg.render.batch <= 64:
        problems.append(f"render.batch must be 1..64 (got {cfg.render.batch})")
    if cfg.render.workers < 0:
        problems.append(f"render.workers must be >= 0, 0 = one per core (got {cfg.render.workers})")
    try:
        ZoneInfo(cfg.timezone)
    except (ZoneInfoNotFoundError, ValueError):
        problems.append(f"timezone '{cfg.timezone}' is not a known IANA zone (e.g. Asia/Dhaka)")
    urls = {"redis.url / PAYRUN_REDIS_URL": cfg.redis.url, "redis.readonly_url": cfg.redis.readonly_url,
            "email.url / PAYRUN_EMAIL_URL": cfg.email.url, "scheduler.bank_url": cfg.scheduler.bank_url}
    unreadable = {name: why for name, url in urls.items() if (why := url_syntax_problem(url))}
    problems.extend(f"{name} {why} (got {redact_url(urls[name])!r})" for name, why in unreadable.items())

    def readable(name: str) -> str:
        return "" if name in unreadable else urls[name]

    for name, schemes in (("redis.url / PAYRUN_REDIS_URL", ("redis", "rediss", "unix")),
                          ("email.url / PAYRUN_EMAIL_URL", ("smtp", "smtps", "http", "https"))):
        if (url := readable(name)) and urlsplit(url).scheme not in schemes:
            problems.append(f"{name} must start with one of {', '.join(s + '://' for s in schemes)} (got {redact_url(url)!r})"
                            + ("; an address is not a provider: give the mail server's URL (smtp://user:password@host:587),"
                               " and the From address as email.sender" if url.lower().startswith("mailto:") else ""))
    problems.extend(f"email.url / PAYRUN_EMAIL_URL {why} (got {redact_url(cfg.email.url)!r})"
                    for why in email_url_problems(readable("email.url / PAYRUN_EMAIL_URL"), email_token))
    if "scheduler.bank_url" not in unreadable:
        problems.extend(f"scheduler.bank_url {why} (got {redact_url(cfg.scheduler.bank_url)!r})"
                        for why in bank_url_problems(cfg.scheduler.bank_url))
    for name in ("redis.url / PAYRUN_REDIS_URL", "redis.readonly_url"):
        problems.extend(f"{name} {why} (got {redact_url(urls[name])!r})" for why in redis_url_problems(readable(name)))
    from scheduler.cron import entry_problems

    problems.extend(entry_problems(cfg.scheduler.entries))
    sc = cfg.scheduler  # (each value that is wrong, by name: it listed all three rules for one)
    if sc.catchup_window_s < 0:
        problems.append(f"scheduler.catchup_window_s must be >= 0 s (got {sc.catchup_window_s:g})")
    if sc.poll_s <= 0:
        problems.append(f"scheduler.poll_s must be > 0 s (got {sc.poll_s:g})")
    if sc.lock_ttl_s < 1:
        problems.append(f"scheduler.lock_ttl_s must be >= 1 s (got {sc.lock_ttl_s:g})")
    problems = [*(known or []), *problems]
    if problems:  # (one line: it goes into every supervised program's log as one record)
        raise ConfigError("invalid configuration: " + "; ".join(problems))


def url_syntax_problem(url: str) -> str | None:
    """Why ``url`` cannot be read at all (pure), or None: a port that is not a number, an
    unclosed IPv6 bracket, a Redis ``db`` that is not a number (redis-py's own reading).
    Otherwise every command died of a bare ValueError traceback."""
    if not url:
        return None
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a bad one
        if parts.scheme in ("redis", "rediss", "unix"):
            from redis.connection import parse_url

            parse_url(url)
    except ValueError as e:
        return f"is not a valid URL ({e})"
    return None


def redis_url_problems(url: str) -> list[str]:
    """What is unsafe about an external Redis URL (pure): Redis holds every slip's payload
    (names, addresses, salaries), so it needs a password, and anything but a unix socket
    or this host's loopback needs TLS (``rediss://``)."""
    if not url:
        return []
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        return []  # the scheme check above names it
    why = []
    if not (parts.password or parse_qs(parts.query).get("password")):
        why.append("has no password (redis://:PASSWORD@host or unix:///path?password=PASSWORD)")
    if parts.scheme == "redis" and not is_loopback(parts.hostname or ""):
        why.append("reaches another host without TLS: use rediss://")
    return why


def email_url_problems(url: str, token: bool = False) -> list[str]:
    """What an email URL would send in clear text to another host (pure): an SMTP login
    without smtps:// or starttls=1, a bearer token (PAYRUN_EMAIL_TOKEN) over http://, and
    the slips themselves (every earning, deduction and net pay) over smtp:// without
    starttls=1 or http://. ``?insecure=1`` lets the slips go in clear text to a relay the
    owner trusts (credentials never). This host's loopback (a local relay, the local
    provider) is fine."""
    if not url:
        return []
    parts = urlsplit(url)
    if is_loopback(parts.hostname or ""):
        return []
    query = parse_qs(parts.query)

    def on(name: str) -> bool:
        return query.get(name, ["0"])[-1].lower() in ("1", "true", "yes")

    opt_out = "or add ?insecure=1 for a relay you trust on a private network"
    if parts.scheme == "smtp" and not on("starttls"):
        if parts.username:
            return ["would log in to another host in clear text: use smtps:// or add ?starttls=1"]
        if not on("insecure"):
            return [f"would send the salary slips to another host in clear text: use smtps:// or add ?starttls=1 ({opt_out})"]
    if parts.scheme == "http":
        if token:
            return ["would send PAYRUN_EMAIL_TOKEN to another host in clear text: use https://"]
        if not on("insecure"):
            return [f"would send the salary slips to another host in clear text: use https:// ({opt_out})"]
    return []


def bank_url_problems(url: str) -> list[str]:
    """Why scheduler.bank_url will not do (pure): the bank check reads every employee's net
    pay and shows the bank token, so it goes to another host over https:// only."""
    if not url:
        return []  # no bank to check (the bank-status entry then fails, saying so)
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return ["must be an http(s)://host[:port] URL"]
    if parts.scheme == "http" and not is_loopback(parts.hostname):
        return ["would fetch every employee's net pay and send the bank token to another host in clear text: "
                "use https://"]
    return []


def provider_host_problem(host: str) -> str | None:
    """Why the local provider simulator may not listen on ``host`` (pure), or None. It speaks
    plain HTTP: its token (the data directory's, which every sender shows) and every slip
    would cross the network in clear text, and whoever took the token read every recipient
    and subject (/v1/messages), started outages and reset its dedupe (/v1/admin). So it
    listens on this machine's loopback only."""
    if host and is_loopback(host):
        return None
    return (f"must be this machine's loopback (127.0.0.1, ::1 or localhost; got {host!r}): the local "
            "provider simulator speaks plain HTTP, so its token and every slip would cross the network in clear text")


def is_loopback(host: str) -> bool:
    """A host name or address of this machine's loopback ('' and localhost too)."""
    if host in ("", "localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
