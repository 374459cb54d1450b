"""Layer 7, operator actions and reports shared by the CLI, Django's admin and commands."""
