"""The compose suite (`-m compose`): the compose stack run for real under podman. Deselected
unless -m names it (tests/conftest.py); skipped, with the reason, where podman, mmdebstrap,
podman-compose or root is missing."""
