"""payrun: salary slips for every employee before 09:00, as background jobs on RQ + Redis."""

__version__ = "0.1.0"
