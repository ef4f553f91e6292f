"""docker-compose.yaml: no Docker engine here, so its shape is checked instead."""

from __future__ import annotations

import pathlib

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_compose_services_are_pinned_and_wired() -> None:
    # Given the compose file
    compose = yaml.safe_load((ROOT / "docker-compose.yaml").read_text())
    services = compose["services"]
    # Then every image has an explicit tag, never "latest"
    for name, service in services.items():
        image = service.get("image")
        assert image, f"service {name} has no image"
        assert ":" in image and not image.endswith(":latest"), f"{name}: unpinned {image}"
    # And the broker is initialised only once PostgreSQL is healthy, on that database
    init = services["broker-init"]
    assert init["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert "@postgres:5432/" in init["environment"]["SCHEDULER_LIB_DB"]
    assert init["command"] == ["init"]
    assert "healthcheck" in services["postgres"]
    # And the image it builds installs the pinned versions
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "-c constraints.txt" in dockerfile
    assert 'ENTRYPOINT ["scheduler-lib"]' in dockerfile
