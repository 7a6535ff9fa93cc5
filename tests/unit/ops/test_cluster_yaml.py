"""cluster.yaml is a Ray cluster-launcher config Ray itself accepts, for the production layout.

Ray's own code judges it, offline (no cloud calls, no boto3): `prepare_config` (merge with the
provider's defaults.yaml, per-type worker bounds) then `validate_config` (ray-schema.json via
jsonschema, plus the min/max_workers checks), which is what `ray up` runs before it touches
AWS, and `AutoscalingConfig`, the class the head's autoscaler (v2, Ray's default) loads the
config with and asks for each node type's commands and resources. On top of that, the
project's invariants: an 8-GPU head, an 8-GPU and a CPU-only worker type, the dashboard on
loopback, Ray's temp dir and object spill on the NVMe, setup through scripts/setup.sh, the
NVMe and the shared file system mounted on every node type.
"""

import copy
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.providers import _NODE_PROVIDERS
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.autoscaler.v2.instance_manager.config import AutoscalingConfig

REPO = Path(__file__).resolve().parents[3]
NVME, SHARED = "/mnt/nvme", "/mnt/shared"


@pytest.fixture
def raw() -> dict:
    return yaml.safe_load((REPO / "cluster.yaml").read_text())


def _ray_checked(raw: dict) -> dict:
    """What `ray up` does before any cloud call: fill defaults, then validate (raises)."""
    prepared = prepare_config(copy.deepcopy(raw))
    validate_config(prepared)
    return prepared


def _autoscaler_view(raw: dict) -> AutoscalingConfig:
    return AutoscalingConfig(copy.deepcopy(raw), skip_content_hash=True)


def _worker_types(cfg: AutoscalingConfig) -> dict:
    head = cfg.get_head_node_type()
    return {t: c for t, c in cfg.get_node_type_configs().items() if t != head}


def _flag(cmds: list[str], name: str) -> str | None:
    m = re.search(rf"--{name}[= ](\S+)", " ".join(cmds))
    return m.group(1) if m else None


def _spill_dir(cmds: list[str]) -> str | None:
    """The spill directory from --object-spilling-directory or --system-config's
    object_spilling_config (either form configures Ray's filesystem spilling)."""
    text = " ".join(cmds)
    d = _flag(cmds, "object-spilling-directory")
    if d is None and "object_spilling_config" in text:
        m = re.search(r'directory_path\\*"\s*:\s*\\*"([^"\\]+)', text)
        d = m.group(1) if m else None
    return d


def test_ray_schema_accepts_cluster_yaml(raw):
    prepared = _ray_checked(raw)
    assert prepared["provider"]["type"] in _NODE_PROVIDERS and prepared["provider"]["type"] != "local"
    # Every command list is ours: Ray's defaults.yaml commands (a nightly Ray wheel, a conda
    # env, a dashboard on 0.0.0.0) must not have leaked in through a missing key.
    commands = " ".join(c for k in ("initialization_commands", "setup_commands", "head_setup_commands",
                                    "worker_setup_commands", "head_start_ray_commands",
                                    "worker_start_ray_commands") for c in prepared[k])
    for leaked in ("ray-wheels", "anaconda3", "0.0.0.0"):
        assert leaked not in commands
    assert prepared["idle_timeout_minutes"] > 0


def test_ray_schema_rejects_broken_configs(raw):
    """The validator is not vacuous: Ray refuses what it must refuse."""
    bad = copy.deepcopy(raw)
    bad["available_node_types"]["worker_cpu"]["gpus"] = 0  # not a node-type field
    with pytest.raises(jsonschema.ValidationError):
        _ray_checked(bad)
    bad = copy.deepcopy(raw)
    bad["available_node_types"]["worker_8gpu"]["resources"]["GPU"] = "8"  # must be an integer
    with pytest.raises(jsonschema.ValidationError):
        _ray_checked(bad)
    bad = copy.deepcopy(raw)
    bad["available_node_types"]["worker_cpu"]["min_workers"] = raw["max_workers"] + 1
    with pytest.raises(ValueError, match="max_workers"):
        _ray_checked(bad)


def test_node_types_head_8gpu_plus_gpu_and_cpu_workers(raw):
    cfg = _autoscaler_view(raw)
    types = cfg.get_node_type_configs()
    for name, t in types.items():
        assert isinstance(t.resources.get("CPU"), int) and t.resources["CPU"] > 0, name
        assert isinstance(t.resources.get("GPU"), int), f"{name}: GPU count not declared"
        node = cfg.get_cloud_node_config(name)
        assert {"InstanceType", "ImageId", "BlockDeviceMappings"} <= node.keys(), name
    assert types[cfg.get_head_node_type()].resources["GPU"] == 8
    workers = _worker_types(cfg)
    gpu = [t for t in workers.values() if t.resources["GPU"] == 8 and t.max_worker_nodes >= 1]
    cpu = [t for t in workers.values() if t.resources["GPU"] == 0 and t.max_worker_nodes >= 1]
    assert gpu, "no 8-GPU worker type (the trainer's node while the target holds the head)"
    assert cpu, "no CPU-only worker type (GPU: 0)"
    assert all(t.max_worker_nodes <= cfg.get_max_num_worker_nodes() for t in workers.values())


def test_ray_start_dashboard_on_loopback_temp_and_spill_on_nvme(raw):
    cfg = _autoscaler_view(raw)
    for role, cmds in (("head", cfg.get_head_start_ray_commands()),
                       ("worker", cfg.get_worker_start_ray_commands())):
        start = [c for c in cmds if " start " in f" {c} "]
        assert len(start) == 1, role
        # The Ray that setup.sh installed, on every node.
        assert "eagle_ray/.venv/bin/ray start" in start[0], role
        spill = _spill_dir(start)
        assert spill and spill.startswith(NVME + "/"), f"{role}: object spilling dir not on the NVMe"
        assert (_flag(start, "temp-dir") or "").startswith(NVME + "/"), role
        assert _flag(start, "object-store-memory"), role
    head = cfg.get_head_start_ray_commands()
    assert "--head" in " ".join(head)
    assert _flag(head, "dashboard-host") == "127.0.0.1"
    assert _flag(head, "autoscaling-config") == "~/ray_bootstrap_config.yaml"
    assert _flag(head, "object-store-memory").isdigit()
    assert _flag(cfg.get_worker_start_ray_commands(), "address") == "$RAY_HEAD_IP:6379"


def test_every_node_type_mounts_nvme_and_shared_storage_and_runs_setup_sh(raw):
    cfg = _autoscaler_view(raw)
    head_cmds = cfg.get_head_start_ray_commands()
    spill, temp = _spill_dir(head_cmds), _flag(head_cmds, "temp-dir")
    head = cfg.get_head_node_type()
    for name in cfg.get_node_type_configs():
        # The head runs the global initialization_commands (a head type's own are ignored).
        init = " ".join(cfg.get_config("initialization_commands") if name == head
                        else cfg.get_initialization_commands(name))
        assert f"mountpoint -q {NVME}" in init and f"mountpoint -q {SHARED}" in init, name
        assert spill in init and temp in init, f"{name}: spill/temp dirs not created"
        setup = (cfg.get_head_setup_commands() if name == head
                 else cfg.get_worker_setup_commands(name))
        assert any("cd ~/eagle_ray" in c and "bash scripts/setup.sh" in c for c in setup), name
        if cfg.get_node_type_configs()[name].resources["GPU"]:
            assert "nvidia-smi" in init + " ".join(setup), f"{name}: GPUs declared, never checked"
    # The stack setup.sh is told to install is one it has.
    for dev in re.findall(r"EAGLE_RAY_DEVICE=(\w+)", " ".join(cfg.get_head_setup_commands())):
        assert (REPO / "requirements" / f"{dev}.txt").is_file()
    # ~/eagle_ray is this repository (`ray up` runs from its root), without the local venv.
    mounts = cfg.get_config("file_mounts")
    assert (REPO / mounts["~/eagle_ray"]).resolve() == REPO
    assert any(".venv" in p for p in cfg.get_config("rsync_exclude"))
