"""Errors payrun reports to its user. The CLI prints ``str(error)`` as one line and exits 2
(1 for RedisUnavailable: the system is down, not the input wrong).

PayrunError
 ├── ConfigError        bad configuration or environment (names the setting and the value)
 ├── InputError         bad user input: a CSV row, an argument (names the line or option)
 ├── RedisUnavailable   no Redis at the configured URL / embedded server would not start
 └── SetupError         a system library or binary is missing (says how to install it)
"""


class PayrunError(Exception):
    """Base of every error shown to the user as one line."""


class ConfigError(PayrunError):
    pass


class InputError(PayrunError):
    pass


class RedisUnavailable(PayrunError):
    pass


class SetupError(PayrunError):
    pass
