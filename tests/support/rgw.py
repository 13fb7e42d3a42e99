"""A throw-away single-node Ceph RGW on loopback, the third S3 implementation in the tests.

Owns the node's bootstrap (a monitor, one memstore OSD, radosgw with the beast frontend,
one S3 user), its ``ceph.conf``, ports, credentials, readiness, and killing/restarting
the gateway alone. Everything lives in one temp dir and runs in one process group
(:class:`ec_s3.sandbox.procgroup.ProcessGroup`): a bash leader that bootstraps and then
waits, with radosgw joined to its group, so :meth:`RgwServer.stop` (or the reaper when
the test process dies) takes every daemon down at once. Does not own buckets
(callers create them) nor installing Ceph (Debian's ``radosgw ceph-mon ceph-osd
ceph-common``; :meth:`RgwServer.unavailable_reason` says what is missing).

The settings that matter, and why, are in ``/work/shared/NOTES.md`` ("More S3 servers");
each one carries its reason below too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
import uuid
from pathlib import Path

from ec_s3.sandbox.net import LOOPBACK, free_port, wait_answering
from ec_s3.sandbox.procgroup import ProcessGroup, log_tail

from .loopback_server import LoopbackServer, ServerError

__all__ = ["RgwServer"]

_BINARIES = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "monmaptool", "ceph-authtool", "ceph")
_INSTALL_HINT = "apt-get install -y --no-install-recommends radosgw ceph-mon ceph-osd ceph-common"


def _ceph_conf(d: Path, fsid: str, mon_port: int, rgw_port: int) -> str:
    return f"""[global]
fsid = {fsid}
# msgr2 only: one port, and no v1 listener to collide with
mon_host = [v2:{LOOPBACK}:{mon_port}]
ms_bind_msgr1 = false
public_addr = {LOOPBACK}
# no cephx: a throw-away node on loopback; radosgw's default 'secure' mon mode then
# loops on EACCES, so the mon link is crc
auth_cluster_required = none
auth_service_required = none
auth_client_required = none
ms_mon_client_mode = crc
# data in RAM, one replica
osd_objectstore = memstore
osd_pool_default_size = 1
osd_pool_default_min_size = 1
mon_allow_pool_size_one = true
osd_pool_default_pg_autoscale_mode = off
mon_warn_on_pool_no_redundancy = false
# the default 1 s makes radosgw's first start (it creates its pools) take ~13 s
paxos_propose_interval = 0.05
run_dir = {d}/run
admin_socket = {d}/run/$name.asok
pid_file = {d}/run/$name.pid
log_file = {d}/log/$name.log
mon_data = {d}/mon/$name
osd_data = {d}/osd/$name
keyring = {d}/keyring
crash_dir = {d}/crash
exec_dir = {d}/run

[client.rgw]
rgw_frontends = beast endpoint={LOOPBACK}:{rgw_port}
rgw_dns_name = {LOOPBACK}
# deleted data otherwise stays in the OSD's RAM for 2 h
rgw_gc_obj_min_wait = 60
rgw_gc_processor_period = 60
# a lifecycle "day" is 10 s, so a test can see a rule act
rgw_lc_debug_interval = 10
"""


# The leader: bootstrap the cluster (monitor, OSD, S3 user), then run radosgw each time
# RgwServer asks (a file "gw.go"), so that a test can kill the gateway alone and start it
# again (the soak's "server restart": the storage behind a gateway keeps its data). It
# ends when the monitor or the OSD does. Everything stays in its process group (another
# session's process may not join it, so RgwServer cannot start radosgw itself).
_BOOTSTRAP = r"""
set -eu
C="-c $D/ceph.conf"
mkdir -p "$D/run" "$D/log" "$D/mon/mon.a" "$D/osd/osd.0" "$D/crash"
touch "$D/gw.go"  # radosgw starts as soon as the cluster is up
monmaptool --create --clobber --fsid "$FSID" --addv a "[v2:127.0.0.1:$MON_PORT]" "$D/monmap" >/dev/null
ceph-authtool --create-keyring "$D/keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
ceph-mon $C --mkfs -i a --monmap "$D/monmap" --keyring "$D/keyring"
ceph-mon $C -f -i a &
MON=$!
OSD_UUID=$(cat /proc/sys/kernel/random/uuid)
OSD_ID=$(ceph $C --connect-timeout 30 osd new "$OSD_UUID")
# the mon ignores an OSD's boot unless its fsid is the one 'osd new' registered
ceph-osd $C -i "$OSD_ID" --mkfs --osd-uuid "$OSD_UUID" >/dev/null 2>&1
ceph-osd $C -f -i "$OSD_ID" &
OSD=$!
radosgw-admin $C -n client.rgw user create --uid=ecs3 --display-name=ecs3 \
    --access-key="$RGW_ACCESS_KEY" --secret-key="$RGW_SECRET_KEY" >/dev/null
touch "$D/bootstrapped"
alive() { kill -0 "$MON" 2>/dev/null && kill -0 "$OSD" 2>/dev/null; }
while alive; do
    if [ -e "$D/gw.go" ]; then
        rm -f "$D/gw.go"
        radosgw $C -n client.rgw -f >>"$D/gateway.log" 2>&1 &
        echo $! >"$D/gw.pid"
        wait $! || true
        rm -f "$D/gw.pid"
    fi
    sleep 0.05
done
echo "=== a ceph daemon exited"
"""


class RgwServer(LoopbackServer):
    """One Ceph RGW node serving S3 on 127.0.0.1 with enforced SigV4 credentials."""

    _dir_prefix = "ec-s3-rgw-"
    _stop_grace_s = 0.5  # memstore keeps nothing worth a clean shutdown: the group goes at once

    @staticmethod
    def unavailable_reason() -> str | None:
        """None when every Ceph binary the node needs is on PATH, else what to install."""
        missing = [b for b in _BINARIES if shutil.which(b) is None]
        if not missing:
            return None
        return f"Ceph RGW not installed (missing {', '.join(missing)}): {_INSTALL_HINT}"

    def _launch(self, scratch: Path) -> None:
        """Bootstrap the node and wait until radosgw answers HTTP."""
        self._spawn(scratch)
        error = self._wait_bootstrapped()
        if error is not None:
            raise ServerError(f"RGW failed to start ({error}); {self._logs()}")
        self._wait_gateway()

    def kill_gateway(self) -> None:
        """SIGKILL radosgw alone (no clean shutdown) and wait until it is gone; the
        cluster and its data stay."""
        with self._lock:
            pid = self._gateway_pid()
            if pid is None:
                return
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while self._gateway_pid() == pid and time.monotonic() < deadline:
                time.sleep(0.02)  # the leader reaps it and removes gw.pid

    def start_gateway(self) -> None:
        """Start radosgw again on the node's port and wait until it answers."""
        with self._lock:
            if self._group is None or self._dir is None or self._port is None:
                raise ServerError("server not started")
            (self._dir / "gw.go").touch()
            self._wait_gateway()

    def _wait_gateway(self) -> None:
        assert self._group is not None and self._port is not None
        error = wait_answering(self._port, self._group.poll, self._startup_timeout_s, "the node")
        if error is not None:
            raise ServerError(f"radosgw failed to start ({error}); {self._logs()}")

    def _gateway_pid(self) -> int | None:
        assert self._dir is not None
        try:
            return int((self._dir / "gw.pid").read_text())
        except (OSError, ValueError):
            return None

    def _spawn(self, d: Path) -> None:
        mon_port, self._port = free_port(), free_port()
        fsid = str(uuid.uuid4())
        (d / "ceph.conf").write_text(_ceph_conf(d, fsid, mon_port, self._port))
        env = {
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": str(d),
            "D": str(d),
            "FSID": fsid,
            "MON_PORT": str(mon_port),
            "RGW_ACCESS_KEY": self._credentials.access_key_id,
            "RGW_SECRET_KEY": self._credentials.secret_access_key,
        }
        # The secret travels in the environment, never on the leader's command line.
        self._group = ProcessGroup(["bash", "-c", _BOOTSTRAP], log_path=d / "bootstrap.log", env=env,
                                   label="rgw", cwd=d, reaper_grace_s=2.0, scratch=d)

    def _wait_bootstrapped(self) -> str | None:
        assert self._group is not None and self._dir is not None
        deadline = time.monotonic() + self._startup_timeout_s
        while not (self._dir / "bootstrapped").exists():
            code = self._group.poll()
            if code is not None:
                return f"bootstrap exited with status {code}"
            if time.monotonic() > deadline:
                return f"not bootstrapped after {self._startup_timeout_s:.0f} s"
            time.sleep(0.05)
        return None

    def _logs(self) -> str:
        assert self._dir is not None
        parts = [f"bootstrap log:\n{log_tail(self._dir / 'bootstrap.log', 2000)}"]
        parts.append(f"gateway log:\n{log_tail(self._dir / 'gateway.log', 1500)}")
        for name in ("mon.a", "osd.0", "client.rgw"):
            path = self._dir / "log" / f"{name}.log"
            if path.exists():
                parts.append(f"{name}:\n{log_tail(path, 1500)}")
        return "\n".join(parts)
