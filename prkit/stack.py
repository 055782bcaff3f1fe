"""The stack: fake workers (prkit.fake_workers) + a real Envoy on the demo config (envoy/envoy.yaml,
from prkit.envoy_config) with the compiled filter, on test ports. Nothing is mocked on the Envoy
side.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from . import envoy_config as ec
from .build import wasm_path
from .envoy import Envoy
from .fake_workers import WorkerPool
from .ports import free_port


class Stack:
    """Fake workers + Envoy on the demo config (prkit.envoy_config profile demo: its models, worker
    names and plugin configuration) with the workers' real ports and `plugin_overrides` merged into
    the plugin configuration; the unit the fixtures hand to tests."""

    def __init__(self, *, plugin_overrides: dict | None = None):
        demo = ec.profile("demo")
        self.names = [w.cluster for ws in demo.models.values() for w in ws]
        self.pool = WorkerPool(self.names)
        self.tmp = Path(tempfile.mkdtemp(prefix="prefix-router-it-"))
        listener_port, admin_port = free_port(), free_port()
        opts = ec.local_demo(self.pool.ports, listen=listener_port, admin=admin_port, wasm=str(wasm_path()),
                             plugin=plugin_overrides)
        self.plugin = ec.plugin_config(opts)
        self.envoy = Envoy(ec.render(opts), listener_port=listener_port, admin_port=admin_port, workdir=self.tmp)

    def start(self):
        try:
            self.envoy.start()
        except Exception:
            self.close(keep_logs=True)
            raise
        return self

    def close(self, keep_logs: bool = False):
        self.envoy.stop()
        self.pool.close()
        if not keep_logs:
            shutil.rmtree(self.tmp, ignore_errors=True)

    @property
    def load_eps(self) -> float:
        return float(self.plugin.get("policy", {}).get("load_eps", 1.0))

    @property
    def load_slack(self) -> float:
        return float(self.plugin.get("policy", {}).get("load_slack", 3.0))
