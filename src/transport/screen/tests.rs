//! Unit tests of `screen`.

use super::*;

fn reply(line: &str) -> Value {
    match screen(line.as_bytes()) {
        Screened::Reply(reply) => reply,
        other => panic!("expected a reply to {line}, got {other:?}"),
    }
}

fn code_and_id(reply: &Value) -> (i64, Value) {
    (
        reply["error"]["code"].as_i64().unwrap_or_default(),
        reply["id"].clone(),
    )
}

fn call(arguments: &str) -> String {
    format!(
        r#"{{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{{"name":"terminal_execute","arguments":{arguments}}}}}"#
    )
}

#[test]
fn lone_surrogates_become_the_replacement_character() {
    assert_eq!(repair_lone_surrogates(r#""a\ud800b""#), r#""a\ufffdb""#);
    assert_eq!(repair_lone_surrogates(r#""\udc00""#), r#""\ufffd""#);
    assert_eq!(
        repair_lone_surrogates(r#""\udc00\ud800""#),
        r#""\ufffd\ufffd""#
    );
    assert_eq!(repair_lone_surrogates(r#""\ud800""#), r#""\ufffd""#);
}

#[test]
fn whole_pairs_and_other_escapes_are_kept() {
    for text in [
        r#""\ud83d\ude00""#,
        r#""\\ud800""#,
        r#""\"\ud83d\ude00\n""#,
        r#"{"k":"v"} \ud800"#,
    ] {
        assert!(
            matches!(repair_lone_surrogates(text), Cow::Borrowed(_)),
            "{text}"
        );
    }
}

#[test]
fn a_call_with_a_lone_surrogate_reaches_the_handler_repaired() {
    let Screened::Message(message) = screen(call(r#"{"command":"echo \ud800"}"#).as_bytes()) else {
        panic!("not handed on");
    };
    let JsonRpcMessage::Request(request) = *message else {
        panic!("not a request");
    };
    let ClientRequest::CallToolRequest(call) = request.request else {
        panic!("not a tool call");
    };
    let command = call
        .params
        .arguments
        .and_then(|a| a.get("command").cloned());
    assert_eq!(command, Some(Value::from("echo \u{fffd}")));
}

#[test]
fn out_of_range_numbers_are_invalid_params_with_the_id() {
    for number in ["1e400", "-1e400", &"9".repeat(400)] {
        let answer = reply(&call(&format!(
            r#"{{"command":"true","timeout":{number}}}"#
        )));
        assert_eq!(code_and_id(&answer), (-32602, json!(5)), "{number}");
    }
    let answer = reply(r#"{"jsonrpc":"2.0","id":1e400,"method":"ping"}"#);
    assert_eq!(code_and_id(&answer), (-32600, Value::Null));
    assert!(matches!(
        screen(br#"{"jsonrpc":"2.0","method":"notifications/x","params":{"n":1e400}}"#),
        Screened::Skip
    ));
}

#[test]
fn malformed_lines_get_the_json_rpc_error_for_their_kind() {
    let cases: &[(&str, i64, Value)] = &[
        ("not json", -32700, Value::Null),
        (
            r#"{"jsonrpc":"2.0","id":3,"method":"ping""#,
            -32700,
            Value::Null,
        ),
        (r#"{"jsonrpc":"2.0","id":7}"#, -32600, json!(7)),
        (
            r#"{"jsonrpc":"2.0","id":"s","method":3}"#,
            -32600,
            json!("s"),
        ),
        (
            r#"{"jsonrpc":"1.0","id":4,"method":"ping"}"#,
            -32600,
            json!(4),
        ),
        (
            r#"{"jsonrpc":"2.0","id":{},"method":"ping"}"#,
            -32600,
            Value::Null,
        ),
        (
            r#"[{"jsonrpc":"2.0","id":1,"method":"ping"}]"#,
            -32600,
            Value::Null,
        ),
        ("42", -32600, Value::Null),
        (&call(r#""echo hi""#), -32602, json!(5)),
        (&call("[1]"), -32602, json!(5)),
        (
            r#"{"jsonrpc":"2.0","id":6,"method":"tools/call","params":{"arguments":{}}}"#,
            -32602,
            json!(6),
        ),
        (
            r#"{"jsonrpc":"2.0","id":9,"method":"tools/list","params":"x"}"#,
            -32602,
            json!(9),
        ),
    ];
    for (line, code, id) in cases {
        assert_eq!(code_and_id(&reply(line)), (*code, id.clone()), "{line}");
    }
}

#[test]
fn good_messages_and_blank_lines_pass() {
    for line in [
        r#"{"jsonrpc":"2.0","id":1,"method":"ping"}"#,
        r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
        &call(r#"{"command":"echo \ud83d\ude00"}"#),
    ] {
        assert!(
            matches!(screen(line.as_bytes()), Screened::Message(_)),
            "{line}"
        );
    }
    // Not one of rmcp's typed requests: handed on, so the handler says "method not found".
    assert!(matches!(
        screen(br#"{"jsonrpc":"2.0","id":2,"method":"tasks/list","params":{}}"#),
        Screened::Message(_)
    ));
    assert!(matches!(screen(b"  "), Screened::Skip));
    assert!(matches!(screen(b""), Screened::Skip));
}

#[test]
fn invalid_utf8_is_replaced_not_refused() {
    let mut line = call(r#"{"command":"echo X"}"#).into_bytes();
    let at = line.iter().position(|b| *b == b'X').unwrap_or_default();
    line[at] = 0xFF;
    assert!(matches!(screen(&line), Screened::Message(_)));
}

#[test]
fn an_over_long_line_is_answered_with_its_id_when_it_comes_first() {
    let head = br#"{"jsonrpc":"2.0","id":"big-1","method":"tools/call","params":{"x":"aaaa"#;
    assert_eq!(
        code_and_id(&oversized(head, b"aaaa\"}}")),
        (-32600, json!("big-1"))
    );
    let late = br#"{"jsonrpc":"2.0","params":{"x":"aaaa"#;
    assert_eq!(
        code_and_id(&oversized(late, b"aaaa\"}}")),
        (-32600, Value::Null)
    );
    let nested = br#"{"params":{"id":1,"s":"}\"{"},"id":12,"method":"tools/call"}"#;
    assert_eq!(code_and_id(&oversized(nested, b"")), (-32600, json!(12)));
    assert_eq!(
        code_and_id(&oversized(b"garbage", b"garbage")),
        (-32600, Value::Null)
    );
}

#[test]
fn an_over_long_line_is_answered_with_its_id_when_it_comes_last() {
    // The official Python SDK's order: method, params, jsonrpc, id.
    let head =
        br#"{"method":"tools/call","params":{"name":"file_write","arguments":{"content":"QUFB"#;
    let tail = br#"QUFB","id":"x"}},"jsonrpc":"2.0","id":7}
"#;
    assert_eq!(code_and_id(&oversized(head, tail)), (-32600, json!(7)));
    let string_id = br#"QUFB"}},"jsonrpc":"2.0", "id" : "req-\"}9" }"#;
    assert_eq!(
        code_and_id(&oversized(head, string_id)),
        (-32600, json!("req-\"}9"))
    );
    // An `id` inside params that happens to end the tail is not the request's.
    let nested_only = br#"QUFB","id":5}}"#;
    assert_eq!(
        code_and_id(&oversized(head, nested_only)),
        (-32600, Value::Null)
    );
    // A tail that starts inside a string holding `"id":` text.
    let inside = br#"id":3,"id":4}"#;
    assert_eq!(code_and_id(&oversized(head, inside)), (-32600, json!(4)));
}
