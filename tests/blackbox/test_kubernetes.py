"""The `kubernetes` backend in pod mode end to end, with the official Python MCP client against
the built server on the local fake of the Kubernetes API server (`fakes/kubernetes.py`, run in
this process; Pods are local `sandbox-busybox:full` containers). These show the server drives
our reading of Kubernetes' published definitions correctly; no real cluster has run them
(docs/kubernetes.md).

Covered: every startup refusal (unknown context, unreachable API server, missing namespace,
missing permissions listed together, a storage size that does not parse, a sandbox-mode flag in
pod mode), two
principals each with a computer over HTTP, a temporary Pod deleted when its session ends, a
permanent computer with its home volume and a running job found again after a server restart,
a port reached through pods/portforward, idle stop ending a permanent computer's Pod and keeping
its volume (refused without one), and egress rules kept as the computer's NetworkPolicy
(made before its Pod, deleted with it and by crash GC; the fake stores it and does not enforce it).
Every test asserts the fake saw no request outside the published definitions."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import time

import anyio
import httpx
import pytest

from fakes.kubernetes import FakeKubernetes
from harness import BIN, BUSYBOX, apoll, free_port, wait_exit
from test_principals import ALICE, BOB

pytestmark = [pytest.mark.anyio, pytest.mark.client_independent]

TOKEN = "k8s-blackbox-token"
TOKENS = {ALICE: "alice-" + "a" * 40, BOB: "bob-" + "b" * 40}


@pytest.fixture
def fake():
    with FakeKubernetes(namespaces=["default", "team"], tokens=[TOKEN]) as k8s:
        yield k8s
        assert k8s.violations() == [], k8s.violations()
    left = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=fakek8s={k8s.run}"], capture_output=True,
                          text=True).stdout.split()
    assert left == [], "the fake left containers behind"


def kubeconfig(path, url: str, token: str = TOKEN, namespace: str = "default"):
    path.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters:\n- name: fake\n  cluster:\n    server: {url}\n"
        f"users:\n- name: fake\n  user:\n    token: {token}\n"
        f"contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: {namespace}\n"
        "current-context: fake\n"
    )
    return path


def k8s_args(*extra: str, mode: str = "pod") -> list[str]:
    # The fake serves the agent-sandbox CRDs, so without --k8s-mode the server would choose
    # sandbox mode (test_kubernetes_sandbox.py); these are the pod-mode tests.
    return ["--backend", "k8s", "--k8s-mode", mode, "--image", BUSYBOX, "--shell", "/bin/sh", *extra]


def env_for(config) -> dict:
    return {"KUBECONFIG": str(config)}


def run_cli(kbb, config, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([BIN, *args], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
                          env=kbb.env(kbb.home(), env_for(config)))


def error_of(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("kilntainers: error: ")]
    assert len(lines) == 1, proc.stderr
    assert proc.stdout == "", "stdout carries only MCP traffic"
    return lines[0].removeprefix("kilntainers: error: ")


def pod_of(fake: FakeKubernetes, name: str, namespace: str = "default") -> dict | None:
    return fake.get("pods", namespace, name)


def test_startup_refuses_an_unknown_context(kbb, fake, tmp_path):
    config = kubeconfig(tmp_path / "kubeconfig", fake.url)
    message = error_of(run_cli(kbb, config, *k8s_args("--k8s-context", "production")))
    assert message.startswith("Kubernetes context 'production' is not in the kubeconfig"), message


def test_startup_refuses_an_unreachable_api_server_naming_it(kbb, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    config = kubeconfig(tmp_path / "kubeconfig", url)
    message = error_of(run_cli(kbb, config, *k8s_args()))
    assert message.startswith(f"Cannot reach the Kubernetes API server at {url}/"), message


def test_startup_refuses_a_missing_namespace(kbb, fake, tmp_path):
    config = kubeconfig(tmp_path / "kubeconfig", fake.url)
    message = error_of(run_cli(kbb, config, *k8s_args("--k8s-namespace", "nowhere")))
    assert message == (
        "Kubernetes namespace 'nowhere' does not exist; create it or choose another with --k8s-namespace "
        "(KILNTAINERS_K8S_NAMESPACE)."
    )
    # The namespace of the kubeconfig's context is the default.
    other = kubeconfig(tmp_path / "other", fake.url, namespace="elsewhere")
    assert "namespace 'elsewhere' does not exist" in error_of(run_cli(kbb, other, *k8s_args()))


def test_startup_lists_every_missing_permission(kbb, fake, tmp_path):
    fake.deny("create", "pods/exec")
    fake.deny("delete", "persistentvolumeclaims")
    config = kubeconfig(tmp_path / "kubeconfig", fake.url)
    message = error_of(run_cli(kbb, config, *k8s_args("--k8s-namespace", "team")))
    assert message == (
        "The Kubernetes credentials lack permissions this server needs in namespace 'team': create pods/exec, "
        "delete persistentvolumeclaims. Apply the Role in deploy/kubernetes/rbac.yaml (docs/kubernetes.md) to "
        "the account the server runs as."
    )
    reviews = fake.requests_matching("POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews")
    assert len(reviews) == 12, "one review per permission used"
    # Without home volumes the claim permissions are not needed.
    proc = run_cli(kbb, config, *k8s_args("--k8s-namespace", "team", "--k8s-storage", "0"))
    assert "create pods/exec." in error_of(proc), proc.stderr


@pytest.mark.parametrize(("args", "start"), [
    (["--k8s-storage", "10GB"], "--k8s-storage must be a Kubernetes quantity such as 10Gi, 500Mi or 1G, or 0 for no volume; got '10GB'."),
    (["--k8s-warm-pool", "pool"], "--k8s-warm-pool belongs to sandbox mode (the agent-sandbox CRDs), but --k8s-mode is pod"),
    (["--egress", "allowlist", "--egress-allow", "pypi.org"],
     "--egress allowlist: 'pypi.org' names a host, and a Kubernetes NetworkPolicy takes only address blocks (CIDRs)"),
    (["--egress", "allowlist", "--egress-ask", "--egress-allow", "203.0.113.7"],
     "--egress allowlist: --egress-ask needs the egress proxy, which the kubernetes backend does not run"),
    (["--egress-deny", "203.0.113.7:22"],
     "--egress open: deny rule '203.0.113.7:22' has a port, and a NetworkPolicy cannot take one port out"),
])
def test_startup_refuses_what_pod_mode_cannot_do(kbb, fake, tmp_path, args, start):
    config = kubeconfig(tmp_path / "kubeconfig", fake.url)
    message = error_of(run_cli(kbb, config, *k8s_args(*args)))
    assert message.startswith(start), message
    assert fake.requests_matching("POST", "/api/v1/namespaces/default/pods") == []


async def test_a_temporary_pod_runs_commands_and_goes_with_its_session(kbb, fake, tmp_path):
    config = kubeconfig(tmp_path / "kubeconfig", fake.url)
    async with kbb.server(*k8s_args(), env=env_for(config)) as srv:
        res = (await srv.call({"command": "cat; echo \"$KILNTAINERS_EXEC_ID\" | wc -c; exit 3",
                               "stdin": "from stdin\n"})).ok()
        assert res.structured["stdout"] == "from stdin\n37\n"
        assert res.structured["exit_code"] == 3 and res.structured["temporary"] is True
        name = res.structured["computer_id"]
        pod = pod_of(fake, name)
        assert pod is not None
        spec = pod["spec"]
        assert spec["automountServiceAccountToken"] is False and "env" not in spec["containers"][0]
        assert spec["activeDeadlineSeconds"] == 86400
        assert pod["metadata"]["labels"]["kilntainers.temporary"] == "true"
        assert pod["metadata"]["labels"]["kilntainers.instance"] == srv.instance_id
        timed = (await srv.call({"command": "sleep 30", "timeout": 1})).ok()
        assert timed.structured["exit_code"] == 124
    deadline = time.monotonic() + 15
    while pod_of(fake, name) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pod_of(fake, name) is None, "temporary Pod not deleted when the session ended"


HELPER_CMDLINE = re.compile(r"/\.kilntainers/helper-[0-9a-f]{16} serve ")
PARENT = "tr '\\0' ' ' < /proc/$PPID/cmdline"


def execs_of(fake: FakeKubernetes, pod: str) -> list[dict]:
    return fake.requests_matching("GET", f"/api/v1/namespaces/default/pods/{pod}/exec")


async def test_commands_share_one_resident_helper_exec_and_a_replaced_helper_is_put_back(kbb, fake, tmp_path):
    config = kubeconfig(tmp_path / "kubeconfig", fake.url)
    async with kbb.server(*k8s_args(), env=env_for(config)) as srv:
        first = (await srv.run(PARENT)).ok()
        assert HELPER_CMDLINE.fullmatch(first.structured["stdout"]), first.structured
        name = first.structured["computer_id"]
        execs = len(execs_of(fake, name))
        for code in range(4):
            res = (await srv.call({"command": f"cat; echo err >&2; exit {code}", "computer_id": name,
                                   "stdin": f"in {code}\n"})).ok()
            assert res.structured["stdout"] == f"in {code}\n" and res.structured["stderr"] == "err\n"
            assert res.structured["exit_code"] == code
        timed = (await srv.call({"command": "sleep 30", "timeout": 1, "computer_id": name})).ok()
        assert timed.structured["exit_code"] == 124
        # Commands, stdin and the timeout's kill all went over the helper's stream.
        assert len(execs_of(fake, name)) == execs, [r["query"] for r in execs_of(fake, name)[execs:]]
        # A root user replaces the helper and ends it: that command is interrupted, the next
        # one uploads ours again and runs through it.
        hostile = await srv.call({"command": "path=$(tr '\\0' '\\n' < /proc/$PPID/cmdline | head -n 1); "
                                  "printf '#!/bin/sh\\necho hijacked\\n' > \"$path\"; kill -9 $PPID; sleep 5",
                                  "computer_id": name})
        assert hostile.is_error or hostile.structured["exit_code"] != 0, hostile
        again = (await srv.run(PARENT, computer_id=name)).ok()
        assert HELPER_CMDLINE.fullmatch(again.structured["stdout"]), again.structured
        elf = (await srv.run("head -c 4 /.kilntainers/helper-*", computer_id=name)).ok()
        assert elf.structured["stdout"] == "\x7fELF", elf.structured
        uploads = [r for r in execs_of(fake, name)[execs:] if "cat > " in " ".join(r["query"].get("command", []))]
        assert len(uploads) == 1, [r["query"] for r in execs_of(fake, name)[execs:]]


async def test_with_the_helper_off_every_command_is_its_own_exec(kbb, fake, tmp_path):
    config = kubeconfig(tmp_path / "kubeconfig", fake.url)
    async with kbb.server(*k8s_args("--exec-helper", "off"), env=env_for(config)) as srv:
        first = (await srv.run("echo $PPID")).ok()
        assert first.structured["stdout"] == "0\n"
        name = first.structured["computer_id"]
        execs = len(execs_of(fake, name))
        (await srv.run("true", computer_id=name)).ok()
        assert len(execs_of(fake, name)) == execs + 1
        assert not any("cat > " in " ".join(r["query"].get("command", [])) for r in execs_of(fake, name))


def pooled_pods(fake: FakeKubernetes) -> list[dict]:
    return fake.listed("pods", "default", "kilntainers.pooled=true")


async def pool_ready(srv, size: int = 1, timeout: float = 90.0) -> dict:
    """`computer_list` once the server says `size` spares are ready to be handed out."""
    deadline = time.monotonic() + timeout
    while True:
        listing = (await srv.call({}, name="computer_list")).ok().structured
        if listing["warm_pool"]["ready"] == size:
            return listing
        assert time.monotonic() < deadline, f"the pool did not fill: {listing['warm_pool']}"
        await anyio.sleep(0.1)


async def test_warm_pool_hands_a_started_spare_pod_to_a_session_and_refills(kbb, fake, tmp_path):
    config = kubeconfig(tmp_path / "kubeconfig", fake.url)
    permanent = kbb.new_id("pool-perm")
    async with kbb.server(*k8s_args("--warm-pool", "1", "--lifecycle-tools"), env=env_for(config)) as srv:
        listing = await pool_ready(srv)
        assert listing["warm_pool"] == {"ready": 1, "size": 1} and listing["computers"] == [], listing
        [spare] = pooled_pods(fake)
        spare_name, spare_uid = spare["metadata"]["name"], spare["metadata"]["uid"]
        assert spare_name.startswith("kilntainers-spare-")
        assert spare["metadata"]["labels"]["kilntainers.instance"] == srv.instance_id
        made = len(fake.requests_matching("POST", "/api/v1/namespaces/default/pods"))

        first = (await srv.run(PARENT)).ok()
        name = first.structured["computer_id"]
        # The spare's Pod became the computer: same Pod, relabelled; no Pod made for it.
        pod = fake.get("pods", "default", spare_name)
        assert pod["metadata"]["uid"] == spare_uid
        assert pod["metadata"]["annotations"]["kilntainers.computer-id"] == name
        assert pod["metadata"]["labels"]["kilntainers.name"] == name
        assert fake.get("pods", "default", name) is None
        # Its helper was put in while the spare was checked: the first command only connected.
        assert HELPER_CMDLINE.fullmatch(first.structured["stdout"]), first.structured
        uploads = [r for r in execs_of(fake, spare_name) if "cat > " in " ".join(r["query"].get("command", []))]
        assert len(uploads) == 1, uploads

        # The pool refills with a new spare; the computer is listed under its id.
        listing = await pool_ready(srv)
        assert [c["computer_id"] for c in listing["computers"]] == [name], listing
        refills = [p for p in pooled_pods(fake) if p["metadata"]["name"] != spare_name]
        assert len(refills) == 1, refills
        assert len(fake.requests_matching("POST", "/api/v1/namespaces/default/pods")) == made + 1

        # Later commands, a restart and a permanent computer (never from the pool).
        assert (await srv.run("echo again", computer_id=name)).ok().structured["stdout"] == "again\n"
        (await srv.call({"computer_id": name}, name="computer_restart")).ok()
        assert fake.get("pods", "default", spare_name) is None
        assert (await srv.run("echo restarted", computer_id=name)).ok().structured["stdout"] == "restarted\n"
        (await srv.run("true", computer_id=permanent, temporary=False)).ok()
        assert fake.get("pods", "default", permanent) is not None
        assert len(pooled_pods(fake)) == 1, "the restart and the permanent computer used no spare"
        (await srv.call({"computer_id": permanent}, name="computer_delete")).ok()
    # The session's computer and the waiting spare went with the server.
    left = fake.listed("pods", "default", f"kilntainers.instance={srv.instance_id}")
    assert left == [], [p["metadata"]["name"] for p in left]


async def test_crash_gc_takes_a_dead_servers_spares_handed_out_or_not(kbb, fake, tmp_path):
    config = kubeconfig(tmp_path / "kubeconfig", fake.url)
    home = kbb.home()
    async with kbb.server(*k8s_args("--warm-pool", "1", "--lifecycle-tools"), home=home,
                          env=env_for(config)) as a:
        await pool_ready(a)
        (await a.run("true")).ok()
        await pool_ready(a)
        instance = a.instance_id
        assert len(pooled_pods(fake)) == 2  # one handed out, one waiting
        os.kill(a.pid, signal.SIGKILL)
        assert wait_exit(a, 10) == -signal.SIGKILL
    async with kbb.server(*k8s_args(), home=home, env=env_for(config)) as b:
        (await b.run("true")).ok()
        gone = await apoll(lambda: fake.listed("pods", "default", f"kilntainers.instance={instance}") == [], 30, 0.2)
        assert gone, [p["metadata"]["name"] for p in pooled_pods(fake)]


def test_warm_pool_is_refused_in_sandbox_mode(kbb, fake, tmp_path):
    config = kubeconfig(tmp_path / "kubeconfig", fake.url)
    message = error_of(run_cli(kbb, config, *k8s_args("--warm-pool", "2", mode="sandbox")))
    assert message.startswith("--warm-pool (KILNTAINERS_WARM_POOL) keeps spare Pods in pod mode only"), message
    assert "--k8s-warm-pool" in message


async def test_two_principals_each_have_their_own_computer(kbb, fake, tmp_path):
    config = kubeconfig(tmp_path / "kubeconfig", fake.url)
    tokens = tmp_path / "tokens"
    tokens.write_text("".join(f"{p}  {t}\n" for p, t in TOKENS.items()))
    tokens.chmod(0o600)
    box = kbb.new_id("box")
    async with kbb.http_server("--auth-tokens-file", str(tokens), "--lifecycle-tools", *k8s_args(),
                               env=env_for(config)) as srv:
        async with kbb.http_session(srv, headers={"Authorization": f"Bearer {TOKENS[ALICE]}"}) as alice, \
                kbb.http_session(srv, headers={"Authorization": f"Bearer {TOKENS[BOB]}"}) as bob:
            for who, sess in (("alice", alice), ("bob", bob)):
                out = (await sess.run(f"echo {who} > /root/owner; cat /root/owner; hostname",
                                      computer_id=box, temporary=False)).ok()
                assert out.structured["stdout"].split()[0] == who
            names = {}
            for who in TOKENS:
                tag = hashlib.sha256(who.encode()).hexdigest()[:16]
                names[who] = f"{box}-{tag}"
                pod = pod_of(fake, names[who])
                assert pod is not None, f"no Pod {names[who]}"
                assert pod["metadata"]["annotations"]["kilntainers.owner"] == who
                assert pod["metadata"]["annotations"]["kilntainers.computer-id"] == f"{box}.{tag}"
                assert fake.get("persistentvolumeclaims", "default", names[who]) is not None
            assert pod_of(fake, box) is None
            for who, sess in (("alice", alice), ("bob", bob)):
                out = (await sess.run("cat /root/owner", computer_id=box, temporary=False)).ok()
                assert out.structured["stdout"] == f"{who}\n"
                listed = (await sess.call({}, name="computer_list")).ok()
                assert [c["computer_id"] for c in listed.structured["computers"]] == [box]
            for sess in (alice, bob):
                (await sess.call({"computer_id": box}, name="computer_delete")).ok()
            for who in TOKENS:
                assert pod_of(fake, names[who]) is None
                assert fake.get("persistentvolumeclaims", "default", names[who]) is None


async def test_a_permanent_computer_and_its_job_are_found_after_a_server_restart(kbb, fake, tmp_path):
    config = kubeconfig(tmp_path / "kubeconfig", fake.url)
    home = kbb.home()
    cid = kbb.new_id("perm")
    args = k8s_args("--job-tools", "--lifecycle-tools")
    async with kbb.server(*args, home=home, env=env_for(config)) as srv:
        (await srv.run("echo kept > /root/state", computer_id=cid, temporary=False)).ok()
        started = (await srv.call({"command": "echo begin; read line; echo \"got $line\"", "computer_id": cid,
                                   "temporary": False, "yield_after": 1, "keep_stdin_open": True})).ok()
        job = started.structured["job_id"]
        assert started.structured["running"] is True
    assert len(fake.requests_matching("POST", "/api/v1/namespaces/default/pods")) == 1
    assert pod_of(fake, cid) is not None, "a permanent computer outlives its server"
    async with kbb.server(*args, home=home, env=env_for(config)) as srv:
        out = (await srv.run("cat /root/state", computer_id=cid, temporary=False)).ok()
        assert out.structured["stdout"] == "kept\n"
        assert len(fake.requests_matching("POST", "/api/v1/namespaces/default/pods")) == 1, "found, not made again"
        (await srv.call({"job_id": job, "stdin": "hello\n", "close_stdin": True}, name="job_write")).ok()
        stdout = ""
        deadline = time.monotonic() + 30
        while True:
            res = (await srv.call({"job_id": job, "since": 0, "wait": 2}, name="job_output")).ok()
            stdout = res.structured["stdout"]
            if not res.structured["running"] or time.monotonic() > deadline:
                break
        assert stdout == "begin\ngot hello\n" and res.structured["exit_code"] == 0, res.structured
        restarted = (await srv.call({"computer_id": cid}, name="computer_restart")).ok()
        assert restarted.structured is not None
        out = (await srv.run("cat /root/state", computer_id=cid, temporary=False)).ok()
        assert out.structured["stdout"] == "kept\n", "the home volume survives a restart"
        (await srv.call({"computer_id": cid}, name="computer_delete")).ok()
    assert pod_of(fake, cid) is None
    assert fake.get("persistentvolumeclaims", "default", cid) is None


async def test_idle_stop_ends_the_pod_keeps_the_volume_and_the_next_command_makes_it_again(kbb, fake, tmp_path):
    # See: issue 37 (what Docker offers, on a cluster); docs/idle-stop.md, docs/kubernetes.md "Idle stop".
    config = kubeconfig(tmp_path / "kubeconfig", fake.url)
    cid, scratch = kbb.new_id("idle"), kbb.new_id("idle-tmp")
    args = k8s_args("--idle-stop", "2s", "--lifecycle-tools", "--egress-deny", "203.0.113.0/24")
    async with kbb.server(*args, env=env_for(config)) as srv:
        (await srv.run("echo kept > /root/kept", computer_id=cid, temporary=False)).ok()
        (await srv.run("true", computer_id=scratch, temporary=True)).ok()
        first = pod_of(fake, cid)["metadata"]["uid"]
        deadline = time.monotonic() + 30
        while pod_of(fake, cid) is not None and time.monotonic() < deadline:
            (await srv.call({}, name="computer_list")).ok()  # looking is not use
            await anyio.sleep(0.25)
        assert pod_of(fake, cid) is None, "the idle permanent computer's Pod was not ended"
        # What the computer is made of stays: its volume, its NetworkPolicy, and so its place in the list.
        assert fake.get("persistentvolumeclaims", "default", cid) is not None
        assert fake.get("networkpolicies", "default", cid) is not None
        listed = (await srv.call({}, name="computer_list")).ok()
        states = {row["computer_id"]: row["state"] for row in listed.structured["computers"]}
        assert states.get(cid) == "stopped", states
        assert pod_of(fake, scratch) is not None, "a temporary computer was stopped"
        # The next command makes the Pod again, with the home volume's files.
        out = (await srv.run("cat /root/kept", computer_id=cid, temporary=False)).ok()
        assert out.structured["stdout"] == "kept\n" and out.structured["exit_code"] == 0
        assert pod_of(fake, cid)["metadata"]["uid"] != first, "a new Pod, not the old one"
        (await srv.call({"computer_id": cid}, name="computer_delete")).ok()
    assert pod_of(fake, cid) is None
    assert fake.get("persistentvolumeclaims", "default", cid) is None


def test_idle_stop_is_refused_without_a_home_volume(kbb, fake, tmp_path):
    config = kubeconfig(tmp_path / "kubeconfig", fake.url)
    message = error_of(run_cli(kbb, config, *k8s_args("--idle-stop", "1h", "--k8s-storage", "0")))
    assert message.startswith("--idle-stop is not available on the kubernetes backend without a home volume"), message
    assert "--k8s-storage" in message


async def test_a_port_is_reached_through_port_forward(kbb, fake, tmp_path):
    config = kubeconfig(tmp_path / "kubeconfig", fake.url)
    computer = kbb.new_id("web")
    async with kbb.server(*k8s_args("--file-tools", "--job-tools"), env=env_for(config)) as srv:
        (await srv.call({"computer_id": computer, "path": "/www/index.html", "content": "hello pod\n"},
                        name="file_write")).ok()
        refused = await srv.call({"computer_id": computer, "port": 8000}, name="port_url")
        assert refused.is_error and "Nothing accepts connections on port 8000" in refused.text, refused.text
        started = (await srv.call({"computer_id": computer, "command": "busybox httpd -f -p 8000 -h /www",
                                   "yield_after": 1})).ok()
        assert started.structured["running"] is True
        deadline = time.monotonic() + 20
        while True:
            res = await srv.call({"computer_id": computer, "port": 8000}, name="port_url")
            if not res.is_error or time.monotonic() > deadline:
                break
        url = res.ok().structured["url"]
        page = httpx.get(url + "index.html", timeout=10)
        assert page.status_code == 200 and page.text == "hello pod\n"
        assert fake.requests_matching("GET", f"/api/v1/namespaces/default/pods/{computer}/portforward")


def request_index(fake: FakeKubernetes, method: str, pattern: str) -> int:
    rx = re.compile(pattern)
    with fake.lock:
        return next(i for i, r in enumerate(fake.requests) if r["method"] == method and rx.fullmatch(r["path"]))


async def test_egress_rules_become_a_network_policy_made_before_the_pod_and_gone_with_it(kbb, fake, tmp_path):
    # See: issue 37 ("egress as NetworkPolicy"); spec kubernetes.md §2, egress row.
    config = kubeconfig(tmp_path / "kubeconfig", fake.url)
    args = k8s_args("--egress", "allowlist", "--egress-allow", "203.0.113.0/24", "--egress-allow", "198.51.100.7:8443",
                    "--egress-deny", "203.0.113.128/25")
    async with kbb.server(*args, env=env_for(config)) as srv:
        res = (await srv.call({"command": "echo hi"})).ok()
        name = res.structured["computer_id"]
        policy = fake.get("networkpolicies", "default", name)
        assert policy is not None, "no NetworkPolicy for the computer"
        spec = policy["spec"]
        assert spec["podSelector"] == {"matchLabels": {"kilntainers": "true", "kilntainers.name": name}}
        assert pod_of(fake, name)["metadata"]["labels"]["kilntainers.name"] == name
        assert spec["policyTypes"] == ["Ingress", "Egress"] and "ingress" not in spec
        assert spec["egress"] == [
            {"to": [{"ipBlock": {"cidr": "203.0.113.0/24", "except": ["203.0.113.128/25"]}}],
             "ports": [{"port": 80, "protocol": "TCP"}, {"port": 443, "protocol": "TCP"}]},
            {"to": [{"ipBlock": {"cidr": "198.51.100.7/32"}}], "ports": [{"port": 8443, "protocol": "TCP"}]},
        ]
        assert policy["metadata"]["labels"]["kilntainers.temporary"] == "true"
        assert policy["metadata"]["labels"]["kilntainers.instance"] == srv.instance_id
        made = request_index(fake, "POST", "/apis/networking.k8s.io/v1/namespaces/default/networkpolicies")
        assert made < request_index(fake, "POST", "/api/v1/namespaces/default/pods"), "the Pod ran before its policy"
        # The model sees the policy the computer runs under.
        net = (await srv.call({"computer_id": name}, name="computer_network")).ok()
        assert net.structured["mode"] == "allowlist", net.structured
        assert net.structured["allow"] == ["203.0.113.0/24", "198.51.100.7:8443"], net.structured
        assert net.structured["deny"] == ["203.0.113.128/25"], net.structured
    deadline = time.monotonic() + 15
    while fake.get("networkpolicies", "default", name) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert fake.get("networkpolicies", "default", name) is None, "NetworkPolicy left after its computer went"


async def test_no_network_is_a_policy_with_no_egress_and_needs_its_permissions(kbb, fake, tmp_path):
    config = kubeconfig(tmp_path / "kubeconfig", fake.url)
    fake.deny("create", "networkpolicies")
    message = error_of(run_cli(kbb, config, *k8s_args("--no-network")))
    assert message.startswith("The Kubernetes credentials lack permissions this server needs in namespace 'default': "
                              "create networkpolicies.networking.k8s.io."), message
    # With the permission back, the computer runs under a policy that lets nothing out.
    with fake.lock:
        fake.denied.clear()
    async with kbb.server(*k8s_args("--no-network", "--k8s-storage", "0"), env=env_for(config)) as srv:
        res = (await srv.call({"command": "echo hi"})).ok()
        name = res.structured["computer_id"]
        spec = fake.get("networkpolicies", "default", name)["spec"]
        assert spec["egress"] == [] and spec["policyTypes"] == ["Ingress", "Egress"], spec


async def test_crash_gc_takes_a_network_policy_a_dead_server_left_without_its_pod(kbb, fake, tmp_path):
    # See: issue 37 (crash GC), docs/kubernetes.md "Egress": nothing a dead server made is left behind.
    config = kubeconfig(tmp_path / "kubeconfig", fake.url)
    home = kbb.home()
    args = k8s_args("--no-network", "--k8s-storage", "0")
    async with kbb.server(*args, home=home, env=env_for(config)) as a:
        name = (await a.run("true")).ok().structured["computer_id"]
        assert fake.get("networkpolicies", "default", name) is not None
        os.kill(a.pid, signal.SIGKILL)
        assert wait_exit(a, 10) == -signal.SIGKILL
    # As if the server had died between the policy and the Pod.
    fake.delete_pod("default", name)
    assert fake.get("networkpolicies", "default", name) is not None
    async with kbb.server(*args, home=home, env=env_for(config)) as b:
        (await b.run("true")).ok()
        gone = await apoll(lambda: fake.get("networkpolicies", "default", name) is None, 30, 0.2)
        assert gone, "crash GC left the dead server's NetworkPolicy"
