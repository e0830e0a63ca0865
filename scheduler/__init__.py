"""Cron ticks (rq-scheduler) that only create jobs. Never imports textual."""
