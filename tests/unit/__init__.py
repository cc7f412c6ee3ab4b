"""Fast unit tests: pure functions only (no process, no world, no campaign); the whole layer
runs in seconds (`.venv/bin/pytest -q tests/unit`)."""
