"""A local Prometheus next to a local cluster (Debian's `prometheus` binary, installed by
scripts/setup.sh), configured to discover Ray's metrics endpoints and load our alert rules."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from monitoring import alerts, prometheus_config
from monitoring.prometheus_api import PrometheusAPI


class LocalPrometheus:
    def __init__(self, *, port: int = 9090, rules: list | None = None, scrape_interval_s: float = 5.0,
                 discovery_file: str = prometheus_config.RAY_DISCOVERY_FILE, workdir: Path | None = None):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self._rules = rules if rules is not None else alerts.alert_rules(2.0, 0.2)
        self._scrape_interval_s = scrape_interval_s
        self._discovery_file = discovery_file
        self._workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="moe-serve-prometheus-"))
        self._process: subprocess.Popen | None = None

    def start(self, progress: Callable[[str], None] = lambda m: None, timeout_s: float = 60.0) -> "LocalPrometheus":
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("the `prometheus` binary is not installed; run scripts/setup.sh (apt package prometheus)")
        self._workdir.mkdir(parents=True, exist_ok=True)
        (self._workdir / "alerts.yml").write_text(alerts.render(self._rules))
        config = prometheus_config.prometheus_config(discovery_file=self._discovery_file,
                                                     scrape_interval_s=self._scrape_interval_s)
        (self._workdir / "prometheus.yml").write_text(prometheus_config.render(config))
        log = open(self._workdir / "prometheus.log", "ab")
        self._process = subprocess.Popen(
            [binary, f"--config.file={self._workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self._workdir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
             # No --web.enable-lifecycle: nothing here reloads or quits it over HTTP, and with it
             # any local process could (it is stopped by its process, as it was started).
             "--storage.tsdb.retention.time=1d"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        api = PrometheusAPI(self.url)
        deadline = time.monotonic() + timeout_s
        while not api.ready():
            if self._process.poll() is not None:
                raise RuntimeError(f"prometheus exited ({self._process.returncode}); see {self._workdir / 'prometheus.log'}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"prometheus not ready after {timeout_s:g}s; see {self._workdir / 'prometheus.log'}")
            time.sleep(0.3)
        api.close()
        progress(f"prometheus at {self.url} (config and data in {self._workdir})")
        return self

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
        self._process = None
