"""File-based EDS for pool models: writes the DiscoveryResponse a pool cluster's
`eds_config.path_config_source` watches (`envoy/gen --model NAME=eds:PATH`). Envoy picks up a
file replaced by rename, not one edited in place, so every write goes through a rename."""

from __future__ import annotations

import json
import os
from pathlib import Path

CLA = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"


def write_eds(path: Path, service: str, hosts: list[tuple[str, int]], version: int) -> None:
    """`service`'s endpoints are `hosts` ((ip, port) pairs) from now on."""
    doc = {"version_info": str(version), "resources": [{
        "@type": CLA,
        "cluster_name": service,
        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {
            "address": h, "port_value": p}}}} for h, p in hosts]}]}]}
    tmp = path.parent / f".{path.name}.tmp"
    tmp.write_text(json.dumps(doc))
    os.rename(tmp, path)


def write_local_eds(path: Path, service: str, ports: list[int], version: int) -> None:
    """`service`'s endpoints are `ports` on 127.0.0.1 (local fleets) from now on."""
    write_eds(path, service, [("127.0.0.1", p) for p in ports], version)
