from pathlib import Path

import pytest

from cluster import SlurmCluster, add_hosts_entry, missing, remove_hosts_entry


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running two-node Slurm cluster (n1, n2 on this host) for the module's tests."""
    why = missing()
    assert why is None, why  # install.sh installs the packages: a missing one is a broken set-up, not a skip
    added = add_hosts_entry()
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    try:
        yield cluster
    finally:
        cluster.stop()
        if added:
            remove_hosts_entry()
        # A `ray start --head` that is stopped by a signal leaves /tmp/ray/ray_current_cluster
        # naming its address: a plain ray.init() elsewhere on this host would try to join it.
        record = Path("/tmp/ray/ray_current_cluster")
        if record.is_file() and record.read_text().split(":")[0] in ("n1", "n2"):
            record.unlink()
