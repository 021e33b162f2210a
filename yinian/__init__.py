"""The `yinian` command."""
