"""Configuration loading and the validation messages users see."""

import json
import re
from pathlib import Path

import pytest

from payrun import config
from payrun.errors import ConfigError


def load(tmp_path, toml: str, mode: int = 0o600, **env):
    p = tmp_path / "payrun.toml"
    p.write_text(toml)
    p.chmod(mode)
    return config.load(p, env={"PAYRUN_HOME": str(tmp_path / "h"), **env})


def test_a_config_file_with_credentials_must_be_owner_only(tmp_path):
    """Security review (session 31): a config file may hold the Redis password (which reads
    every salary), an SMTP login or the bank token, and was read whatever its mode."""
    for text, named in (("[scheduler]\nbank_token = 'x'\n", "scheduler.bank_token"),
                        ("[redis]\nurl = 'rediss://:pw@redis.internal/0'\n", "redis.url"),
                        ("[redis]\nreadonly_url = 'unix:///r.sock?password=pw'\n", "redis.readonly_url"),
                        ("[email]\nurl = 'smtps://u:pw@mail.example'\n", "email.url")):
        for mode, how in ((0o644, "read"), (0o604, "read"), (0o602, "changed")):
            with pytest.raises(ConfigError, match=rf"holds credentials \({named}\) and can be {how} by every user "
                                                  rf"\(mode {mode:o}\): chmod o-rwx .*payrun.toml"):
                load(tmp_path, text, mode=mode, PAYRUN_REDIS_URL="unix:///tmp/x.sock?password=s")
        for mode in (0o600, 0o640):  # (root:payrun 0640: a group the owner chose)
            load(tmp_path, text, mode=mode, PAYRUN_REDIS_URL="unix:///tmp/x.sock?password=s")
    # no credential in it: any mode will do
    assert load(tmp_path, "[render]\ntimeout_s = 20\n[email]\nurl = 'smtps://mail.example'\n", mode=0o644).render.timeout_s == 20


def test_defaults_are_the_seed_numbers(tmp_path):
    c = config.load(env={"PAYRUN_HOME": str(tmp_path)})
    assert (c.render.timeout_s, c.lease.visibility_s, c.lease.grace_s) == (30, 60, 30)
    assert (c.limits.email_concurrency, c.limits.email_rate_per_s, c.limits.db_concurrency) == (50, 40.0, 60)
    assert (c.render.retry.base_s, c.render.retry.cap_s, c.render.retry.attempts) == (1.0, 300.0, 6)
    assert c.timezone == "Asia/Dhaka"
    assert c.home == tmp_path


def test_a_render_batch_outside_1_to_64_is_refused_with_its_value(tmp_path):
    assert config.load(env={"PAYRUN_HOME": str(tmp_path)}).render.batch == 16
    assert load(tmp_path, "[render]\nbatch = 1\n").render.batch == 1
    for bad in (0, 65):
        with pytest.raises(ConfigError) as e:
            load(tmp_path, f"[render]\nbatch = {bad}\n")
        assert f"render.batch must be 1..64 (got {bad})" in str(e.value)


def test_timeout_at_or_above_lease_is_refused_naming_both(tmp_path):
    with pytest.raises(ConfigError) as e:
        load(tmp_path, "[render]\ntimeout_s = 60\n[lease]\nvisibility_s = 60\ngrace_s = 90\n")
    assert "render.timeout_s (60 s)" in str(e.value) and "lease.visibility_s (60 s)" in str(e.value)


def test_bad_scheduler_numbers_are_named_each_with_its_value(tmp_path):
    """A walkthrough's `poll_s = 0` and `catchup_window_s = -5` got all three rules back,
    without which value broke which."""
    with pytest.raises(ConfigError) as e:
        load(tmp_path, "[scheduler]\npoll_s = 0\ncatchup_window_s = -5\n")
    msg = str(e.value)
    assert "scheduler.poll_s must be > 0 s (got 0)" in msg and "scheduler.catchup_window_s must be >= 0 s (got -5)" in msg
    assert "lock_ttl_s" not in msg


def test_grace_below_timeout_is_refused_naming_both(tmp_path):
    with pytest.raises(ConfigError) as e:
        load(tmp_path, "[lease]\ngrace_s = 10\n")
    assert "lease.grace_s (10 s)" in str(e.value) and "render.timeout_s (30 s)" in str(e.value)


def test_unknown_setting_lists_allowed(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown setting 'render.timeout'.*timeout_s"):
        load(tmp_path, "[render]\ntimeout = 5\n")


def test_wrong_type(tmp_path):
    with pytest.raises(ConfigError, match="render.timeout_s' must be int"):
        load(tmp_path, "[render]\ntimeout_s = 'fast'\n")


def test_a_mistyped_setting_is_named_without_its_value(tmp_path):
    """Security review (session 31): the error quoted the value back, and the settings most
    easily mistyped hold secrets; the message reaches cron mail and every program's log."""
    for text, where in (('redis = "redis://:S3cretPw@10.0.0.5:6379/0"\n', "'redis' must be a table, got a string"),
                        ("[scheduler]\nbank_token = 123456789\n", "'scheduler.bank_token' must be str, got an integer"),
                        ('[email]\nurl = ["smtps://u:S3cretSmtp@mail.example"]\n', "'email.url' must be str, got a list")):
        with pytest.raises(ConfigError) as e:
            load(tmp_path, text)
        assert where in str(e.value)
        assert not any(secret in str(e.value) for secret in ("S3cretPw", "123456789", "S3cretSmtp"))


def test_the_bank_is_reached_over_https_unless_it_is_on_this_host(tmp_path):
    """Security review (session 31): http://bank.example was accepted; the check reads every
    employee's net pay and shows the bank token."""
    from payrun.config import bank_url_problems

    for ok in ("http://127.0.0.1:8026", "http://localhost:9000/api", "https://bank.example/api"):
        assert bank_url_problems(ok) == [], ok
    assert bank_url_problems("http://bank.example") == [
        "would fetch every employee's net pay and send the bank token to another host in clear text: use https://"]
    assert bank_url_problems("") == []  # no bank configured
    assert bank_url_problems("ftp://bank.example") == bank_url_problems("https://") == [
        "must be an http(s)://host[:port] URL"]
    with pytest.raises(ConfigError, match=r"scheduler.bank_url would fetch .* use https:// \(got 'http://bank.example/v1'\)"):
        load(tmp_path, "[scheduler]\nbank_url = 'http://bank.example/v1'\n")


def test_an_unreadable_url_is_a_config_error_that_shows_no_password(tmp_path):
    """Security review (session 31): a port that is not a number, an unclosed IPv6 bracket or
    a Redis db that is not a number ended every command in a bare ValueError traceback."""
    for env, said in ((dict(PAYRUN_REDIS_URL="redis://:S3cret@127.0.0.1:notaport/0"), "PAYRUN_REDIS_URL is not a valid URL (Port could not be cast"),
                      (dict(PAYRUN_REDIS_URL="unix:///r.sock?password=S3cret&db=x"), "PAYRUN_REDIS_URL is not a valid URL (Invalid value for 'db'"),
                      (dict(PAYRUN_REDIS_URL="redis://:S3cret@[::1"), "PAYRUN_REDIS_URL is not a valid URL (Invalid IPv6 URL) (got 'redis://***@[::1')"),
                      (dict(PAYRUN_EMAIL_URL="smtps://u:S3cret@mail.example:465x"), "PAYRUN_EMAIL_URL is not a valid URL (Port could not")):
        with pytest.raises(ConfigError, match=re.escape(said)) as e:
            load(tmp_path, "", **env)
        assert "S3cret" not in str(e.value)
    with pytest.raises(ConfigError, match=r"scheduler.bank_url is not a valid URL"):
        load(tmp_path, "[scheduler]\nbank_url = 'http://127.0.0.1:80a'\n")


def test_bad_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        load(tmp_path, "[render\n")
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(tmp_path / "nope.toml", env={})


def test_env_wins_over_file(tmp_path):
    c = load(tmp_path, "[redis]\nurl = 'redis://127.0.0.1:1/0'\n", PAYRUN_REDIS_URL="unix:///tmp/x.sock?password=s3cret")
    assert c.redis.url.startswith("unix://")
    shown = c.to_dict()
    assert "s3cret" not in str(shown)


def test_bad_urls_and_zone(tmp_path):
    with pytest.raises(ConfigError, match="PAYRUN_EMAIL_URL must start with"):
        config.load(env={"PAYRUN_EMAIL_URL": "ftp://x", "PAYRUN_HOME": str(tmp_path)})
    with pytest.raises(ConfigError, match="not a known IANA zone"):
        load(tmp_path, "timezone = 'Mars/Olympus'\n")


def test_redact_url():
    assert config.redact_url("smtp://user:pw@127.0.0.1:25") == "smtp://user:***@127.0.0.1:25"
    assert config.redact_url("unix:///x.sock?password=abc") == "unix:///x.sock?password=***"
    assert config.redact_url("redis://:pw@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    # not URLs (a mistyped setting): shown as given, never mangled into one, credentials hidden
    assert config.redact_url("garbage") == "garbage"
    assert config.redact_url("127.0.0.1:6379") == "127.0.0.1:6379"
    assert config.redact_url("user:pw@127.0.0.1") == "***@127.0.0.1"
    assert config.redact_url("redis:/localhost?password=s3cret") == "redis:/localhost?password=***"
    assert config.redact_url("localhost:6379?db=0&Password=s3cret") == "localhost:6379?db=0&Password=***"
    with pytest.raises(ConfigError, match=r"must start with one of redis://, rediss://, unix:// \(got 'garbage'\)"):
        config.load(env={"PAYRUN_REDIS_URL": "garbage"})
    # an email address given as the provider: the operator's own text, and what to give instead
    # (it read "got '***@example.com'", as if the address held a secret)
    assert config.redact_url("mailto:hr@example.com") == "mailto:hr@example.com"
    assert config.redact_url("mailto:u:pw@example.com") == "***@example.com"
    with pytest.raises(ConfigError, match=r"\(got 'mailto:hr@example.com'\); an address is not a provider"):
        config.load(env={"PAYRUN_EMAIL_URL": "mailto:hr@example.com"})


def test_redact_url_hides_credential_query_parameters(tmp_path):
    """Security review (session 39): only ``password=`` was masked, and only in lower case;
    an HTTP provider's ``?token=`` / ``?api_key=`` or a bank URL's ``?secret=`` printed in
    clear in `payrun config show` and in every error that names the URL."""
    r = config.redact_url
    assert r("https://api.mail.example/v1/send?token=T0K&region=eu") == "https://api.mail.example/v1/send?token=***&region=eu"
    assert r("https://bank.example/v1?API_KEY=k1&apikey=k2&Key=k3&secret=s&access_token=a&month=2026-11") == (
        "https://bank.example/v1?API_KEY=***&apikey=***&Key=***&secret=***&access_token=***&month=2026-11")
    assert r("http://127.0.0.1:8025/send?api%5Fkey=k") == "http://127.0.0.1:8025/send?api%5Fkey=***"
    assert r("unix:///x.sock?Password=abc&db=2") == "unix:///x.sock?Password=***&db=2"
    assert r("https://u:pw@h.example/p?monkey=banana&keys=3#access_token=z") == (
        "https://u:***@h.example/p?monkey=banana&keys=3#access_token=***")  # not a secret's name: kept
    assert r("https://h.example/#section-2") == "https://h.example/#section-2"
    assert r("https://[::1/x?token=abc") == "https://[::1/x?token=***"  # unreadable: the fallback
    assert r("h.example/send?a=1&Token=abc") == "h.example/send?a=1&Token=***"  # no scheme
    # the effective configuration as `payrun config show` prints it
    toml = tmp_path / "payrun.toml"
    toml.write_text('[scheduler]\nbank_url = "https://bank.example/v1?apikey=BANKSECRET"\n')
    cfg = config.load(path=toml, env={"PAYRUN_EMAIL_URL": "https://mail.example/v1?access_token=MAILSECRET"})
    shown = json.dumps(cfg.to_dict(redact=True))
    assert "BANKSECRET" not in shown and "MAILSECRET" not in shown
    assert "https://bank.example/v1?apikey=***" in shown and "https://mail.example/v1?access_token=***" in shown


def test_an_external_redis_needs_a_password_and_tls_off_this_host(tmp_path):
    """Security review: any redis:// URL was taken, with no password or to another host in
    clear text; and readonly_url was not checked at all."""
    from payrun.config import redis_url_problems

    for ok in ("unix:///run/r.sock?password=x", "redis://:pw@127.0.0.1:6379/0", "redis://u:pw@[::1]:6379",
               "redis://:pw@localhost", "rediss://:pw@redis.internal:6380/0", ""):
        assert redis_url_problems(ok) == [], ok
    assert redis_url_problems("redis://10.0.0.5:6379/0") == [
        "has no password (redis://:PASSWORD@host or unix:///path?password=PASSWORD)",
        "reaches another host without TLS: use rediss://"]
    assert redis_url_problems("redis://:@127.0.0.1") == [
        "has no password (redis://:PASSWORD@host or unix:///path?password=PASSWORD)"]
    with pytest.raises(ConfigError, match=r"PAYRUN_REDIS_URL reaches another host without TLS: use rediss:// "
                                          r"\(got 'redis://:\*\*\*@10.0.0.5/0'\)"):
        config.load(env={"PAYRUN_REDIS_URL": "redis://:pw@10.0.0.5/0"})
    with pytest.raises(ConfigError, match="redis.readonly_url has no password"):
        load(tmp_path, "[redis]\nreadonly_url = 'rediss://ro@redis.internal/0'\n",
             PAYRUN_REDIS_URL="rediss://:pw@redis.internal/0")


def test_email_credentials_never_go_to_another_host_in_clear_text(tmp_path):
    """Security review: smtp://user:pass@remote without STARTTLS, or http://remote with the
    provider's token, were accepted."""
    from payrun.config import email_url_problems

    assert email_url_problems("smtp://payroll:pw@mail.example:587") == [
        "would log in to another host in clear text: use smtps:// or add ?starttls=1"]
    assert email_url_problems("http://api.mail.example", token=True) == [
        "would send PAYRUN_EMAIL_TOKEN to another host in clear text: use https://"]
    # session 31's review: the slips themselves (every earning and net pay) in clear text
    assert email_url_problems("smtp://mail.example:25") == [
        "would send the salary slips to another host in clear text: use smtps:// or add ?starttls=1 "
        "(or add ?insecure=1 for a relay you trust on a private network)"]
    assert email_url_problems("http://api.mail.example") == [
        "would send the salary slips to another host in clear text: use https:// "
        "(or add ?insecure=1 for a relay you trust on a private network)"]
    # the opt-out is for the slips only, never for credentials
    assert email_url_problems("smtp://u:pw@mail.example?insecure=1") == [
        "would log in to another host in clear text: use smtps:// or add ?starttls=1"]
    assert email_url_problems("http://api.mail.example?insecure=1", token=True) == [
        "would send PAYRUN_EMAIL_TOKEN to another host in clear text: use https://"]
    for ok, token in (("smtp://payroll:pw@mail.example:587?starttls=1", False), ("smtps://u:pw@mail.example", False),
                      ("smtp://mail.example:25?starttls=1", False), ("smtp://mail.example:25?insecure=1", False),
                      ("smtp://u:pw@127.0.0.1:2525", False), ("smtp://[::1]:25", False),
                      ("https://api.mail.example", True), ("http://127.0.0.1:8025", True),
                      ("http://api.mail.example?insecure=yes", False), ("", True)):
        assert email_url_problems(ok, token) == [], ok
    with pytest.raises(ConfigError, match="PAYRUN_EMAIL_URL would send the salary slips to another host in clear text"):
        load(tmp_path, "", PAYRUN_EMAIL_URL="smtp://relay.internal:25")
    load(tmp_path, "", PAYRUN_EMAIL_URL="smtp://relay.internal:25?insecure=1")  # the owner's call, said out loud
    with pytest.raises(ConfigError, match="PAYRUN_EMAIL_URL would log in to another host in clear text"):
        load(tmp_path, "", PAYRUN_EMAIL_URL="smtp://u:pw@mail.example")
    with pytest.raises(ConfigError, match="would send PAYRUN_EMAIL_TOKEN"):
        load(tmp_path, "", PAYRUN_EMAIL_URL="http://api.mail.example", PAYRUN_EMAIL_TOKEN="t")


def test_readonly_refuses_to_hand_out_the_writable_url(tmp_path, monkeypatch):
    """Security review: with an external Redis and no readonly_url, `--readonly` quietly
    used the full-rights URL."""
    from payrun import redis_server

    c = load(tmp_path, "", PAYRUN_REDIS_URL="rediss://:pw@redis.internal/0")
    with pytest.raises(ConfigError, match="redis.readonly_url is not set"):
        redis_server.url(c, readonly=True, strict=True)
    assert redis_server.url(c, readonly=True) == c.redis.url  # the console's looks, not promised read-only
    c2 = load(tmp_path, "[redis]\nreadonly_url = 'rediss://ro:x@redis.internal/0'\n",
              PAYRUN_REDIS_URL="rediss://:pw@redis.internal/0")
    assert redis_server.url(c2, readonly=True, strict=True) == "rediss://ro:x@redis.internal/0"


def test_booleans_are_typed(tmp_path):
    assert load(tmp_path, "[email.retry]\njitter = false\n").email.retry.jitter is False
    with pytest.raises(ConfigError, match="must be bool"):
        load(tmp_path, "[email.retry]\njitter = 0\n")
    with pytest.raises(ConfigError, match="must be int"):
        load(tmp_path, "[render]\ntimeout_s = true\n")


def test_supervised_programs_get_the_config_file_up_was_given(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from payrun.cli import cli

    conf = tmp_path / "ops.toml"
    conf.write_text("[provider]\nport = 18125\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PAYRUN_CONFIG", raising=False)
    monkeypatch.setenv("PAYRUN_HOME", str(tmp_path / "h"))
    out = CliRunner().invoke(cli, ["--config", "ops.toml", "supervisor-env"])
    assert out.exit_code == 0, out.output
    assert f"export PAYRUN_CONFIG={conf}" in out.output  # absolute: supervisord's programs run elsewhere
    plain = CliRunner().invoke(cli, ["supervisor-env"])
    assert "export PAYRUN_CONFIG=''" in plain.output
    # the deploy steps' supervisorctl -c "$PAYRUN_SUPERVISOR_CONF" works from any directory
    conf_line = next(line for line in plain.output.splitlines() if line.startswith("export PAYRUN_SUPERVISOR_CONF="))
    assert Path(conf_line.split("=", 1)[1]).is_absolute() and Path(conf_line.split("=", 1)[1]).name == "supervisor.conf"


def test_the_default_data_directory_run_from_the_root_is_refused(monkeypatch):
    monkeypatch.chdir("/")
    with pytest.raises(ConfigError, match="the data directory would be /var, a system directory"):
        config.load(env={})
    assert config.load(env={"PAYRUN_HOME": "/srv/payrun/var"}).home == Path("/srv/payrun/var")


def test_every_problem_of_a_config_file_is_reported_at_once(tmp_path):
    """Walkthrough (session 32): a file with an unknown key, a mistyped value and a lease
    below the timeouts took three rounds of `payrun config show`, one problem each."""
    with pytest.raises(ConfigError) as e:
        load(tmp_path, '[render]\ntimeot_s = 120\n[email]\nlanes = "fifty"\n[lease]\nvisibility_s = 5\n')
    text = str(e.value)
    assert text.startswith("invalid configuration: ") and "\n" not in text
    problems = text.removeprefix("invalid configuration: ").split("; ")
    assert "unknown setting 'render.timeot_s'" in problems[0] and "'email.lanes' must be int" in problems[1]
    assert all("lease.visibility_s (5 s)" in p for p in problems[2:]) and len(problems) == 4


def test_a_toml_error_names_the_key_of_its_line_but_never_the_value(tmp_path):
    with pytest.raises(ConfigError, match=r"line 3, column 19\) \(in 'email_rate_per_s = \.\.\.'\)"):
        load(tmp_path, 'timezone = "Asia/Dhaka"\n[limits]\nemail_rate_per_s =\n[redis]\nurl = "redis://:S3cret@h\n')
    with pytest.raises(ConfigError) as e:
        load(tmp_path, '[redis]\nurl = "redis://:S3cret@h\n')
    assert "S3cret" not in str(e.value) and "(in 'url = ...')" in str(e.value)


def test_a_data_directory_that_is_a_file_is_said_in_one_line(tmp_path):
    """PAYRUN_HOME naming a file (or a path under one): `payrun seed` showed a traceback."""
    import pytest
    from click.testing import CliRunner

    from payrun.cli import cli

    f = tmp_path / "afile"
    f.write_text("")
    for home in (f, f / "sub"):
        with pytest.raises(ConfigError, match="is a file, not a directory"):
            config.load(env={"PAYRUN_HOME": str(home)})
        out = CliRunner().invoke(cli, ["seed", "--companies", "1", "--employees", "1"], env={"PAYRUN_HOME": str(home)})
        assert out.exit_code == 2 and out.output.startswith("payrun: ") and "Traceback" not in out.output, out.output
    assert config.load(env={"PAYRUN_HOME": str(tmp_path / "new" / "home")}).home == tmp_path / "new" / "home"


def _crash_with(cfg):
    """A traceback as Textual's crash screen makes it, of a frame holding ``cfg``."""
    from rich.traceback import Traceback

    try:
        raise RuntimeError(type(cfg).__name__)
    except RuntimeError:
        return Traceback(show_locals=True, locals_max_length=5)


def test_no_repr_of_the_configuration_shows_a_credential(tmp_path):
    """Security review (session 39): the Config dataclass's repr held the Redis, read-only
    and SMTP passwords and the bank token in plain text, and Textual's crash screen prints
    every frame's locals (a `cfg` among them) the way rich.pretty does."""
    from rich.pretty import pretty_repr

    cfg = load(tmp_path, "[redis]\nurl = 'rediss://:REDISPW@redis.example/0'\n"
                         "readonly_url = 'rediss://ro:ROPW@redis.example/0'\n"
                         "[email]\nurl = 'smtps://bob:SMTPPW@mail.example'\n"
                         "[scheduler]\nbank_url = 'https://u:BANKPW@bank.example'\nbank_token = 'BANKTOKEN'\n")
    assert cfg.redis.url.endswith("REDISPW@redis.example/0") and cfg.scheduler.bank_token == "BANKTOKEN"
    crash = _crash_with(cfg)
    from rich.console import Console

    out = Console(width=400, record=True, file=open("/dev/null", "w"))
    out.print(crash)
    shown = [repr(cfg), str(cfg), pretty_repr(cfg), pretty_repr(cfg, max_length=5), repr(cfg.redis),
             repr(cfg.email), repr(cfg.scheduler), out.export_text()]
    for text in shown:
        for secret in ("REDISPW", "ROPW", "SMTPPW", "BANKPW", "BANKTOKEN"):
            assert secret not in text, (secret, text[:300])
    assert "redis.example" in repr(cfg) and "bob:***@mail.example" in repr(cfg)  # the rest still reads


def test_a_token_no_http_header_can_carry_is_refused_without_quoting_it(tmp_path):
    """A PAYRUN_EMAIL_TOKEN (or bank token) with a line break in it (pasted with a second
    line) made every send fail with http.client's "Invalid header value b'Bearer <token>…'":
    the token in each job's error, the ledger, `payrun failed`. Refused at start instead,
    naming the variable, never the value."""
    for name, value in (("PAYRUN_EMAIL_TOKEN", "tok-secret-1\nsecond-line"), ("PAYRUN_BANK_TOKEN", "tok-secret-2\x1b"),
                        ("PAYRUN_EMAIL_TOKEN", "tok-secret-3ä")):
        with pytest.raises(ConfigError) as e:
            config.load(env={"PAYRUN_HOME": str(tmp_path), name: value})
        assert f"{name} is not one line of printable ASCII" in str(e.value) and "tok-secret" not in str(e.value)
    (tmp_path / "c.toml").write_text('[scheduler]\nbank_token = "tok-secret-4\\u0007"\n')
    (tmp_path / "c.toml").chmod(0o600)
    with pytest.raises(ConfigError) as e:
        config.load(env={"PAYRUN_HOME": str(tmp_path), "PAYRUN_CONFIG": str(tmp_path / "c.toml")})
    assert "scheduler.bank_token is not one line" in str(e.value) and "tok-secret" not in str(e.value)
    assert config.load(env={"PAYRUN_HOME": str(tmp_path), "PAYRUN_EMAIL_TOKEN": "tok-fine_1.2-3"})
