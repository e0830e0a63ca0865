"""Job functions and the worker runtime. Runs on worker hosts: needs Redis, the email
provider and the slip store, never the SQLite ledger, and never imports textual."""
