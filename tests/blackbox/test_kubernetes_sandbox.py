"""The `kubernetes` backend in sandbox mode (the agent-sandbox CRDs) end to end, with the official
Python MCP client against the built server on the local fake of the Kubernetes API server
(`fakes/kubernetes.py`, run in this process), which plays the agent-sandbox controller: a
Sandbox gets a Pod (a local `sandbox-busybox:full` container) and its home PVC, a SandboxClaim a
Sandbox from its warm pool's template. No real cluster has run these (docs/kubernetes.md).

Covered: sandbox mode chosen when the CRDs are served; a permanent computer (a Sandbox) found
again after a server restart; restart (suspend and resume) keeping the home directory; delete
taking the Sandbox and its PVC; a temporary computer claimed from a warm pool and deleted with
its session; the startup refusals of sandbox mode (no CRDs, a warm pool or template that does
not exist, egress rules with a warm pool); a Sandbox's NetworkPolicy made before it, selecting
its Pod. Every test asserts the fake saw no request outside the published definitions (the
vendored CRDs for the agent-sandbox bodies)."""

from __future__ import annotations

import subprocess

import pytest

from fakes.kubernetes import FakeKubernetes
from harness import BUSYBOX
from test_kubernetes import env_for, error_of, kubeconfig, run_cli

pytestmark = [pytest.mark.anyio, pytest.mark.client_independent]

TOKEN = "k8s-blackbox-token"
SANDBOXES = "/apis/agents.x-k8s.io/v1beta1/namespaces/default/sandboxes"
CLAIMS = "/apis/extensions.agents.x-k8s.io/v1beta1/namespaces/default/sandboxclaims"


@pytest.fixture
def fake():
    with FakeKubernetes(namespaces=["default"], tokens=[TOKEN]) as k8s:
        yield k8s
        assert k8s.violations() == [], k8s.violations()
    left = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=fakek8s={k8s.run}"], capture_output=True,
                          text=True).stdout.split()
    assert left == [], "the fake left containers behind"


def sandbox_args(*extra: str) -> list[str]:
    # No --k8s-mode: the fake serves the Sandbox CRD, so sandbox mode is chosen.
    return ["--backend", "k8s", "--image", BUSYBOX, "--shell", "/bin/sh", *extra]


def add_warm_pool(fake: FakeKubernetes, pool: str, template: str) -> None:
    """A SandboxTemplate whose Pod keeps running, and a SandboxWarmPool of it, as a platform
    engineer would apply them."""
    keep_alive = "trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done"
    for plural, obj in [
        ("sandboxtemplates", {"apiVersion": "extensions.agents.x-k8s.io/v1beta1", "kind": "SandboxTemplate",
                              "metadata": {"name": template},
                              "spec": {"podTemplate": {"spec": {"containers": [
                                  {"name": "computer", "image": BUSYBOX, "command": ["/bin/sh", "-c", keep_alive]}],
                                  "automountServiceAccountToken": False}}}}),
        ("sandboxwarmpools", {"apiVersion": "extensions.agents.x-k8s.io/v1beta1", "kind": "SandboxWarmPool",
                              "metadata": {"name": pool},
                              "spec": {"replicas": 1, "sandboxTemplateRef": {"name": template}}}),
    ]:
        fake.fill_metadata(obj, "default")
        fake.put(plural, "default", obj, "ADDED")


async def test_a_permanent_sandbox_is_found_after_a_server_restart_and_restart_keeps_home(kbb, fake, tmp_path):
    config = kubeconfig(tmp_path / "kubeconfig", fake.url)
    home = kbb.home()
    cid = kbb.new_id("sbx")
    args = sandbox_args("--lifecycle-tools")
    async with kbb.server(*args, home=home, env=env_for(config)) as srv:
        (await srv.run("echo kept > /root/state", computer_id=cid, temporary=False)).ok()
    assert len(fake.requests_matching("POST", SANDBOXES)) == 1
    assert fake.requests_matching("POST", "/api/v1/namespaces/default/pods") == [], "the controller makes Pods"
    sandbox = fake.get("sandboxes", "default", cid)
    assert sandbox is not None, "a permanent computer outlives its server"
    assert "shutdownTime" not in sandbox["spec"]
    assert sandbox["spec"]["podTemplate"]["spec"]["automountServiceAccountToken"] is False
    assert fake.get("persistentvolumeclaims", "default", f"home-{cid}") is not None
    async with kbb.server(*args, home=home, env=env_for(config)) as srv:
        out = (await srv.run("cat /root/state; echo gone > /tmp/scratch", computer_id=cid, temporary=False)).ok()
        assert out.structured["stdout"] == "kept\n"
        assert len(fake.requests_matching("POST", SANDBOXES)) == 1, "found, not made again"
        first_pod = fake.get("pods", "default", cid)["metadata"]["uid"]
        restarted = (await srv.call({"computer_id": cid}, name="computer_restart")).ok()
        assert restarted.structured is not None
        modes = [r["body"] for r in fake.requests_matching("PATCH", f"{SANDBOXES}/{cid}")]
        assert ["Suspended" in m for m in modes] == [True, False], "suspend, then resume"
        assert fake.get("pods", "default", cid)["metadata"]["uid"] != first_pod, "a new Pod"
        out = (await srv.run("cat /root/state; ls /tmp/scratch 2>&1 || true", computer_id=cid,
                             temporary=False)).ok()
        assert out.structured["stdout"].startswith("kept\n"), "the home volume survives a restart"
        assert "No such file" in out.structured["stdout"], "everything else comes from the image again"
        (await srv.call({"computer_id": cid}, name="computer_delete")).ok()
    assert fake.get("sandboxes", "default", cid) is None
    assert fake.get("pods", "default", cid) is None
    assert fake.get("persistentvolumeclaims", "default", f"home-{cid}") is None


async def test_a_temporary_computer_is_claimed_from_the_warm_pool_and_goes_with_its_session(kbb, fake, tmp_path):
    add_warm_pool(fake, "pool", "busybox-template")
    config = kubeconfig(tmp_path / "kubeconfig", fake.url)
    async with kbb.server(*sandbox_args("--k8s-warm-pool", "pool"), env=env_for(config)) as srv:
        out = (await srv.run("echo claimed; hostname")).ok()
        assert out.structured["stdout"].startswith("claimed\npool-"), "runs in the warm pool's Pod"
        claims = fake.listed("sandboxclaims", "default", "kilntainers=true")
        assert len(claims) == 1
        assert claims[0]["spec"]["warmPoolRef"] == {"name": "pool"}
        assert claims[0]["spec"]["lifecycle"]["shutdownPolicy"] == "Delete"
        assert claims[0]["spec"]["lifecycle"]["shutdownTime"].endswith("Z"), "the safety net"
    assert fake.listed("sandboxclaims", "default", None) == []
    assert fake.listed("sandboxes", "default", None) == []
    assert fake.listed("pods", "default", None) == []


def test_startup_refuses_what_sandbox_mode_cannot_find(kbb, fake, tmp_path):
    config = kubeconfig(tmp_path / "kubeconfig", fake.url)
    message = error_of(run_cli(kbb, config, *sandbox_args("--k8s-warm-pool", "nope")))
    assert message == ("The SandboxWarmPool 'nope' (--k8s-warm-pool) does not exist in Kubernetes namespace "
                       "'default'; create it or check the name."), message
    message = error_of(run_cli(kbb, config, *sandbox_args("--k8s-template", "nope")))
    assert message.startswith("The SandboxTemplate 'nope' (--k8s-template) does not exist"), message
    message = error_of(run_cli(kbb, config, *sandbox_args("--warm-pool", "2")))
    assert "--k8s-warm-pool" in message, message
    # A warm pool's Pods run before any NetworkPolicy of ours could select them.
    add_warm_pool(fake, "pool", "busybox-template")
    message = error_of(run_cli(kbb, config, *sandbox_args("--k8s-warm-pool", "pool", "--no-network")))
    assert message.startswith("--egress rules (or --no-network) cannot be kept with --k8s-warm-pool"), message


async def test_a_sandbox_with_egress_rules_has_its_network_policy_before_it_exists(kbb, fake, tmp_path):
    # See: issue 37 ("egress as NetworkPolicy"), sandbox mode.
    config = kubeconfig(tmp_path / "kubeconfig", fake.url)
    args = sandbox_args("--egress", "allowlist", "--egress-allow", "203.0.113.0/24")
    async with kbb.server(*args, env=env_for(config)) as srv:
        name = (await srv.run("echo hi")).ok().structured["computer_id"]
        policy = fake.get("networkpolicies", "default", name)
        assert policy is not None
        selector = policy["spec"]["podSelector"]["matchLabels"]
        pod_labels = fake.get("pods", "default", name)["metadata"]["labels"]
        assert all(pod_labels.get(k) == v for k, v in selector.items()), (selector, pod_labels)
        with fake.lock:
            posts = [r["path"] for r in fake.requests if r["method"] == "POST"]
        assert posts.index("/apis/networking.k8s.io/v1/namespaces/default/networkpolicies") < posts.index(SANDBOXES)
    assert fake.listed("networkpolicies", "default", None) == []
    assert fake.listed("sandboxes", "default", None) == []


def test_sandbox_mode_needs_the_crds(kbb, tmp_path):
    with FakeKubernetes(namespaces=["default"], tokens=[TOKEN], crds=False) as plain:
        config = kubeconfig(tmp_path / "kubeconfig", plain.url)
        message = error_of(run_cli(kbb, config, *sandbox_args("--k8s-mode", "sandbox")))
        assert message.startswith("--k8s-mode sandbox needs the agent-sandbox CRDs"), message
        message = error_of(run_cli(kbb, config, *sandbox_args("--k8s-warm-pool", "pool")))
        assert message.startswith("--k8s-warm-pool belongs to sandbox mode, but this cluster does not serve"), message
        assert plain.violations() == []

