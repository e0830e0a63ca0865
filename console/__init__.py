"""The on-call console (Textual TUI)."""
