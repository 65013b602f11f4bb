//! Unit tests of `parse`.

use super::*;

fn lit(text: &str) -> Part {
    Part::Lit {
        text: text.into(),
        quoted: false,
    }
}

fn qlit(text: &str) -> Part {
    Part::Lit {
        text: text.into(),
        quoted: true,
    }
}

fn one(source: &str) -> Command {
    let script = parse(source).unwrap();
    assert_eq!(script.len(), 1, "{source}");
    assert!(script[0].rest.is_empty());
    assert_eq!(script[0].first.commands.len(), 1);
    script[0].first.commands[0].clone()
}

fn err(source: &str) -> String {
    parse(source).unwrap_err().to_string()
}

#[test]
fn words_and_quotes() {
    let c = one(r#"echo 'a b' "c $X d" e\ f"#);
    assert_eq!(c.words.len(), 4);
    assert_eq!(c.words[1], Word(vec![qlit("a b")]));
    assert_eq!(
        c.words[2],
        Word(vec![
            qlit("c "),
            Part::Var {
                name: "X".into(),
                quoted: true
            },
            qlit(" d")
        ])
    );
    assert_eq!(c.words[3], Word(vec![lit("e"), qlit(" "), lit("f")]));
}

#[test]
fn double_quote_escapes() {
    let c = one(r#"echo "a\"b\\c\$d\`e\n""#);
    assert_eq!(c.words[1], Word(vec![qlit("a\"b\\c$d`e\\n")]));
}

#[test]
fn empty_quotes_make_a_word() {
    let c = one("echo '' \"\"");
    assert_eq!(c.words.len(), 3);
}

#[test]
fn dollar_forms() {
    let c = one("echo $A ${B}x $? a$ $1 'x$Y'");
    assert_eq!(
        c.words[1].0,
        vec![Part::Var {
            name: "A".into(),
            quoted: false
        }]
    );
    assert_eq!(
        c.words[2].0,
        vec![
            Part::Var {
                name: "B".into(),
                quoted: false
            },
            lit("x")
        ]
    );
    assert_eq!(c.words[3].0, vec![Part::Status { quoted: false }]);
    assert_eq!(c.words[4].0, vec![lit("a$")]);
    assert_eq!(c.words[5].0, vec![lit("$1")]);
    assert_eq!(c.words[6].0, vec![qlit("x$Y")]);
}

#[test]
fn lists_and_pipelines() {
    let script = parse("a | b | c && d || e; f\ng").unwrap();
    assert_eq!(script.len(), 3);
    assert_eq!(script[0].first.commands.len(), 3);
    assert_eq!(
        script[0].rest.iter().map(|r| r.0).collect::<Vec<_>>(),
        vec![Connector::And, Connector::Or]
    );
    let negated = parse("! false").unwrap();
    assert!(negated[0].first.negated);
    assert!(parse("a &&\n b").is_ok());
    assert!(parse("").unwrap().is_empty());
    assert!(parse("  # only a comment").unwrap().is_empty());
    assert_eq!(one("echo a#b # c").words.len(), 2);
}

#[test]
fn redirections_anywhere() {
    let c = one("echo >out a 2>&1 b >>log 2>err <in >&2 1>&2");
    assert_eq!(c.words.len(), 3);
    let kinds: Vec<(u8, RedirectKind)> = c.redirects.iter().map(|r| (r.fd, r.kind)).collect();
    assert_eq!(
        kinds,
        vec![
            (1, RedirectKind::Output),
            (2, RedirectKind::Dup(1)),
            (1, RedirectKind::Append),
            (2, RedirectKind::Output),
            (0, RedirectKind::Input),
            (1, RedirectKind::Dup(2)),
            (1, RedirectKind::Dup(2)),
        ]
    );
    assert_eq!(c.redirects[0].target, Word(vec![lit("out")]));
    // A digit word not glued to '>' is an argument.
    assert_eq!(one("echo 2 > f").words.len(), 2);
}

#[test]
fn assignments() {
    let c = one("A=1 B=\"x y\" cmd C=3");
    assert_eq!(c.assignments.len(), 2);
    assert_eq!(c.assignments[0], ("A".into(), Word(vec![lit("1")])));
    assert_eq!(c.assignments[1], ("B".into(), Word(vec![qlit("x y")])));
    assert_eq!(c.words.len(), 2);
    let bare = one("X=");
    assert_eq!(bare.assignments, vec![("X".into(), Word::default())]);
    assert!(bare.words.is_empty());
    assert!(one("1A=2 x").assignments.is_empty());
}

#[test]
fn unsupported_constructs_are_named() {
    for (source, what) in [
        ("echo $(ls)", "$(...) (command substitution)"),
        ("echo `ls`", "`...` (command substitution)"),
        ("echo \"`ls`\"", "`...` (command substitution)"),
        ("echo $((1+2))", "$((...)) (arithmetic)"),
        ("echo ${X:-a}", "${X:-a} (only ${NAME} is supported)"),
        ("sleep 1 &", "& (background job)"),
        ("(cd a)", "( ) (subshell)"),
        ("{ echo a; }", "{ } (command group)"),
        ("cat <<EOF", "<< (here-document)"),
        ("ls &> f", "&>"),
        ("echo {a,b}", "{a,b} (brace expansion)"),
        ("for x in a; do echo; done", "'for' (compound command)"),
        ("echo 3>f", "redirection of file descriptor 3"),
        ("a |& b", "|&"),
    ] {
        assert_eq!(
            err(source),
            format!("kilntainers: unsupported shell syntax: {what}"),
            "{source}"
        );
    }
}

#[test]
fn syntax_errors() {
    assert_eq!(
        err("echo 'abc"),
        "kilntainers: syntax error: unterminated single quote"
    );
    assert_eq!(
        err("echo \"abc"),
        "kilntainers: syntax error: unterminated double quote"
    );
    assert_eq!(
        err("echo a &&"),
        "kilntainers: syntax error: missing command after '&&'"
    );
    assert_eq!(
        err("| b"),
        "kilntainers: syntax error: expected a command, found '|'"
    );
    assert_eq!(
        err("a | | b"),
        "kilntainers: syntax error: expected a command, found '|'"
    );
    assert!(err("echo >").starts_with("kilntainers: syntax error: redirection without"));
    assert_eq!(err("a ;; b"), "kilntainers: syntax error: unexpected ';;'");
}

#[test]
fn braces_and_tilde_literal_when_harmless() {
    assert_eq!(one("echo {a}").words[1], Word(vec![lit("{a}")]));
    assert_eq!(one("ls ~/x").words[1], Word(vec![lit("/x")]));
    assert_eq!(one("cd ~").words[1], Word(vec![qlit("/")]));
    assert_eq!(one("echo a~").words[1], Word(vec![lit("a~")]));
}
