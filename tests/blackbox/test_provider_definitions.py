"""The checks against the providers' official definitions (`fakes/definitions.py`) catch what
they exist to catch, so a green fake run means something: an undeclared body field, a
deprecated query parameter, an operation the definition does not have, a wrong type in a fake
answer, and a field or enum value a `.proto` file does not declare. No server, no Docker.
See: issue 32"""

from __future__ import annotations

from fakes import definitions

FLY = "fly/openapi.json"
E2B = "e2b/openapi.yml"
PROCESS = "e2b/envd/process/process.proto"


def test_issue_32_fly_app_create_with_app_name_is_a_violation():
    fly = definitions.load(FLY)
    assert fly.check_request("POST", "/v1/apps", {}, {"name": "a", "org_slug": "o", "idempotency_key": "k"}) == []
    found = fly.check_request("POST", "/v1/apps", {}, {"app_name": "a", "org_slug": "o"})
    assert found == ["POST /v1/apps body.app_name: not declared by the official definition"]


def test_issue_32_deprecated_and_undeclared_query_parameters_are_violations():
    fly = definitions.load(FLY)
    path = "/v1/apps/a/machines/m/wait"
    assert fly.check_request("GET", path, {"state": "stopped", "version": "v", "timeout": "60"}, None) == []
    [deprecated] = fly.check_request("GET", path, {"state": "stopped", "instance_id": "v"}, None)
    assert "instance_id" in deprecated and "deprecated" in deprecated
    [undeclared] = fly.check_request("DELETE", "/v1/apps/a/machines/m", {"force": "true", "kill": "true"}, None)
    assert "'kill' is not declared" in undeclared
    assert fly.check_request("POST", "/v1/apps", {"wait": "true"}, {"name": "a"}, extra_query=("wait",)) == []


def test_issue_32_unknown_operations_and_wrong_answer_types_are_violations():
    fly = definitions.load(FLY)
    assert fly.check_request("POST", "/v1/apps/a/machines/m/teleport", {}, None) == [
        f"POST /v1/apps/a/machines/m/teleport: no such operation in {FLY}"
    ]
    assert fly.check_answer("GET", "/v1/apps/a/machines/m/wait", 200, {"ok": False, "state": "started"}) == []
    [wrong] = fly.check_answer("GET", "/v1/apps/a/machines/m/wait", 200, {"ok": "no"})
    assert wrong.startswith("answer 200 to GET /v1/apps/{app_name}/machines/{machine_id}/wait.ok")
    e2b = definitions.load(E2B)
    [extra] = e2b.check_request("POST", "/sandboxes", {}, {"templateID": "base", "timeout": 60, "color": "red"})
    assert extra == "POST /sandboxes body.color: not declared by the official definition"


def test_issue_32_proto3_json_bodies_are_checked_against_the_proto_files():
    process = definitions.proto(PROCESS)
    good = {"process": {"cmd": "/bin/sh", "args": ["-c", "true"], "envs": {"A": "b"}}, "stdin": True}
    assert process.check_request("Process/Start", good) == []
    assert process.check_request("Process/Start", {"process": {"cmd": "sh", "shell": True}}) == [
        f"Process/Start request.process.shell: not a field of process.ProcessConfig in {PROCESS}"
    ]
    [signal] = process.check_request("Process/SendSignal", {"process": {"pid": 1}, "signal": "SIGKILL"})
    assert "is not a value of process.Signal" in signal
    assert process.check_answer("Process/Start", {"event": {"end": {"exitCode": 3, "exited": True}}}) == []
