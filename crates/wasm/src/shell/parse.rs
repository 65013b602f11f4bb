//! Tokenizer and parser for the command-string subset of docs/decisions.md, "The go_busybox command interpreter".
//!
//! Hand-written on purpose. The maintained shell parsers on crates.io (brush-parser, yash-syntax)
//! parse all of bash/POSIX — arithmetic, here-documents, functions, case, coprocesses — and hand
//! back words as raw source text that still has to be re-tokenised for quoting and expansion.
//! Using one would mean walking a large foreign AST to reject most of it node by node, while the
//! spec wants the exact construct named in the refusal and nothing run; conch-parser has not
//! been released since 2018. The subset below is small enough to own, and every rule has a unit
//! test in this file.

use std::fmt;

/// One piece of a word, as written. `quoted` pieces never glob-expand or field-split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    Lit {
        text: String,
        quoted: bool,
    },
    Var {
        name: String,
        quoted: bool,
    },
    /// `$?`.
    Status {
        quoted: bool,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Word(pub Vec<Part>);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RedirectKind {
    /// `< f`
    Input,
    /// `> f`
    Output,
    /// `>> f`
    Append,
    /// `N>&M`: the fd becomes a copy of fd M.
    Dup(u8),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Redirect {
    pub fd: u8,
    pub kind: RedirectKind,
    /// Empty for `Dup`.
    pub target: Word,
}

/// One simple command: prefix assignments, words, redirections (any position).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Command {
    pub assignments: Vec<(String, Word)>,
    pub words: Vec<Word>,
    pub redirects: Vec<Redirect>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pipeline {
    pub negated: bool,
    pub commands: Vec<Command>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Connector {
    And,
    Or,
}

/// `p1 && p2 || p3`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AndOr {
    pub first: Pipeline,
    pub rest: Vec<(Connector, Pipeline)>,
}

/// A whole command string: and-or lists run in sequence (`;` or newline).
pub type Script = Vec<AndOr>;

/// Why a command string was refused; nothing has run when this is returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParseError {
    /// A construct outside the subset, named as the user wrote it.
    Unsupported(String),
    Syntax(String),
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unsupported(what) => write!(f, "kilntainers: unsupported shell syntax: {what}"),
            Self::Syntax(what) => write!(f, "kilntainers: syntax error: {what}"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Token {
    Word(Word),
    And,
    Or,
    Pipe,
    /// `;` or newline.
    Sep,
    Bang,
    Redir(u8, RedirOp),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RedirOp {
    In,
    Out,
    Append,
    Dup(u8),
}

fn unsupported<T>(what: &str) -> Result<T, ParseError> {
    Err(ParseError::Unsupported(what.to_owned()))
}

fn syntax<T>(what: impl Into<String>) -> Result<T, ParseError> {
    Err(ParseError::Syntax(what.into()))
}

fn is_name_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_'
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Characters that end an unquoted word.
fn is_meta(c: char) -> bool {
    matches!(
        c,
        ' ' | '\t' | '\n' | '|' | '&' | ';' | '<' | '>' | '(' | ')'
    )
}

struct Lexer<'a> {
    chars: Vec<char>,
    pos: usize,
    _src: &'a str,
}

impl Lexer<'_> {
    fn peek(&self) -> Option<char> {
        self.chars.get(self.pos).copied()
    }

    fn peek_at(&self, offset: usize) -> Option<char> {
        self.chars.get(self.pos + offset).copied()
    }

    fn tokens(mut self) -> Result<Vec<Token>, ParseError> {
        let mut out = Vec::new();
        while let Some(c) = self.peek() {
            match c {
                ' ' | '\t' | '\r' => self.pos += 1,
                '\\' if self.peek_at(1) == Some('\n') => self.pos += 2,
                '\n' | ';' => {
                    if c == ';' && self.peek_at(1) == Some(';') {
                        return syntax("unexpected ';;'");
                    }
                    self.pos += 1;
                    out.push(Token::Sep);
                }
                '#' => {
                    while self.peek().is_some_and(|c| c != '\n') {
                        self.pos += 1;
                    }
                }
                '|' => match self.peek_at(1) {
                    Some('|') => {
                        self.pos += 2;
                        out.push(Token::Or);
                    }
                    Some('&') => return unsupported("|&"),
                    _ => {
                        self.pos += 1;
                        out.push(Token::Pipe);
                    }
                },
                '&' => match self.peek_at(1) {
                    Some('&') => {
                        self.pos += 2;
                        out.push(Token::And);
                    }
                    Some('>') => return unsupported("&>"),
                    _ => return unsupported("& (background job)"),
                },
                '(' | ')' => return unsupported("( ) (subshell)"),
                '<' | '>' => out.push(self.redirect(None)?),
                _ => {
                    // `2>`, `1>&2`, `0<`: an all-digit word glued to a redirection operator.
                    let digits = self.chars[self.pos..]
                        .iter()
                        .take_while(|c| c.is_ascii_digit())
                        .count();
                    if digits > 0 && matches!(self.peek_at(digits), Some('<' | '>')) {
                        let text: String = self.chars[self.pos..self.pos + digits].iter().collect();
                        self.pos += digits;
                        let fd = match text.as_str() {
                            "0" => 0,
                            "1" => 1,
                            "2" => 2,
                            _ => {
                                return unsupported(&format!(
                                    "redirection of file descriptor {text}"
                                ));
                            }
                        };
                        out.push(self.redirect(Some(fd))?);
                        continue;
                    }
                    let at_command_start = matches!(
                        out.last(),
                        None | Some(
                            Token::Sep | Token::And | Token::Or | Token::Pipe | Token::Bang
                        )
                    );
                    let word = self.word()?;
                    if at_command_start
                        && let [
                            Part::Lit {
                                text,
                                quoted: false,
                            },
                        ] = word.0.as_slice()
                    {
                        {
                            match text.as_str() {
                                "!" => {
                                    out.push(Token::Bang);
                                    continue;
                                }
                                "{" | "}" => return unsupported("{ } (command group)"),
                                "if" | "then" | "else" | "elif" | "fi" | "for" | "while"
                                | "until" | "do" | "done" | "case" | "esac" | "function" | "[[" => {
                                    return unsupported(&format!("'{text}' (compound command)"));
                                }
                                _ => {}
                            }
                        }
                    }
                    out.push(Token::Word(word));
                }
            }
        }
        Ok(out)
    }

    fn redirect(&mut self, fd: Option<u8>) -> Result<Token, ParseError> {
        let c = self.peek();
        self.pos += 1;
        if c == Some('<') {
            return match self.peek() {
                Some('<') => unsupported("<< (here-document)"),
                Some('&') => unsupported("<& (descriptor duplication for input)"),
                Some('>') => unsupported("<> (read-write redirection)"),
                _ => Ok(Token::Redir(fd.unwrap_or(0), RedirOp::In)),
            };
        }
        let fd = fd.unwrap_or(1);
        if fd == 0 {
            return unsupported("0> (redirecting standard input to a file)");
        }
        match self.peek() {
            Some('>') => {
                self.pos += 1;
                Ok(Token::Redir(fd, RedirOp::Append))
            }
            Some('|') => unsupported(">|"),
            Some('&') => {
                self.pos += 1;
                match (self.peek(), self.peek_at(1)) {
                    (Some(d @ ('1' | '2')), next) if next.is_none_or(is_meta) => {
                        self.pos += 1;
                        Ok(Token::Redir(fd, RedirOp::Dup(if d == '1' { 1 } else { 2 })))
                    }
                    (Some('-'), _) => unsupported(">&- (closing a descriptor)"),
                    _ => unsupported(">&word (only 2>&1 and >&2 are supported)"),
                }
            }
            _ => Ok(Token::Redir(fd, RedirOp::Out)),
        }
    }

    fn push_lit(parts: &mut Vec<Part>, c: char, quoted: bool) {
        if let Some(Part::Lit { text, quoted: q }) = parts.last_mut()
            && *q == quoted
        {
            text.push(c);
            return;
        }
        parts.push(Part::Lit {
            text: c.to_string(),
            quoted,
        });
    }

    /// Reads one word: quotes, escapes and `$` expansions, up to an unquoted blank or operator.
    fn word(&mut self) -> Result<Word, ParseError> {
        let mut parts = Vec::new();
        let start = self.pos;
        while let Some(c) = self.peek() {
            if is_meta(c) {
                break;
            }
            match c {
                '\\' => {
                    self.pos += 1;
                    match self.peek() {
                        None => Self::push_lit(&mut parts, '\\', false),
                        Some('\n') => self.pos += 1,
                        Some(next) => {
                            self.pos += 1;
                            Self::push_lit(&mut parts, next, true);
                        }
                    }
                }
                '\'' => {
                    self.pos += 1;
                    let mut text = String::new();
                    loop {
                        match self.peek() {
                            None => return syntax("unterminated single quote"),
                            Some('\'') => break,
                            Some(ch) => text.push(ch),
                        }
                        self.pos += 1;
                    }
                    self.pos += 1;
                    parts.push(Part::Lit { text, quoted: true });
                }
                '"' => {
                    self.pos += 1;
                    // An empty "" still makes a (quoted, empty) word.
                    parts.push(Part::Lit {
                        text: String::new(),
                        quoted: true,
                    });
                    loop {
                        match self.peek() {
                            None => return syntax("unterminated double quote"),
                            Some('"') => break,
                            Some('\\') => {
                                self.pos += 1;
                                match self.peek() {
                                    Some(e @ ('"' | '\\' | '$' | '`')) => {
                                        self.pos += 1;
                                        Self::push_lit(&mut parts, e, true);
                                    }
                                    Some('\n') => self.pos += 1,
                                    _ => Self::push_lit(&mut parts, '\\', true),
                                }
                            }
                            Some('`') => return unsupported("`...` (command substitution)"),
                            Some('$') => self.dollar(&mut parts, true)?,
                            Some(ch) => {
                                self.pos += 1;
                                Self::push_lit(&mut parts, ch, true);
                            }
                        }
                    }
                    self.pos += 1;
                }
                '`' => return unsupported("`...` (command substitution)"),
                '$' => self.dollar(&mut parts, false)?,
                '~' if self.pos == start
                    && self.peek_at(1).is_none_or(|n| n == '/' || is_meta(n)) =>
                {
                    // HOME is `/` in every computer: `~` is `/`, `~/x` is `/x`.
                    self.pos += 1;
                    if self.peek() != Some('/') {
                        parts.push(Part::Lit {
                            text: "/".into(),
                            quoted: true,
                        });
                    }
                }
                _ => {
                    self.pos += 1;
                    Self::push_lit(&mut parts, c, false);
                }
            }
        }
        check_brace_expansion(&parts)?;
        Ok(Word(parts))
    }

    /// At a `$`: `$NAME`, `${NAME}`, `$?`; refuses substitutions; otherwise a literal `$`.
    fn dollar(&mut self, parts: &mut Vec<Part>, quoted: bool) -> Result<(), ParseError> {
        self.pos += 1;
        match self.peek() {
            Some('(') if self.peek_at(1) == Some('(') => unsupported("$((...)) (arithmetic)"),
            Some('(') => unsupported("$(...) (command substitution)"),
            Some('?') => {
                self.pos += 1;
                parts.push(Part::Status { quoted });
                Ok(())
            }
            Some('{') => {
                let rest: String = self.chars[self.pos + 1..].iter().collect();
                let Some(end) = rest.find('}') else {
                    return syntax("unterminated ${");
                };
                let inner = &rest[..end];
                let valid = inner.chars().next().is_some_and(is_name_start)
                    && inner.chars().all(is_name_char);
                if inner == "?" {
                    parts.push(Part::Status { quoted });
                } else if valid {
                    parts.push(Part::Var {
                        name: inner.to_owned(),
                        quoted,
                    });
                } else {
                    return unsupported(&format!("${{{inner}}} (only ${{NAME}} is supported)"));
                }
                self.pos += 1 + inner.chars().count() + 1;
                Ok(())
            }
            Some(c) if is_name_start(c) => {
                let mut name = String::new();
                while let Some(c) = self.peek().filter(|c| is_name_char(*c)) {
                    name.push(c);
                    self.pos += 1;
                }
                parts.push(Part::Var { name, quoted });
                Ok(())
            }
            _ => {
                Self::push_lit(parts, '$', quoted);
                Ok(())
            }
        }
    }
}

/// `{a,b}` would be expanded by bash; refuse it instead of passing it through literally.
fn check_brace_expansion(parts: &[Part]) -> Result<(), ParseError> {
    for part in parts {
        if let Part::Lit {
            text,
            quoted: false,
        } = part
            && let Some(open) = text.find('{')
            && let Some(close) = text[open..].find('}')
        {
            let inner = &text[open + 1..open + close];
            if inner.contains(',') || inner.contains("..") {
                return unsupported(&format!("{{{inner}}} (brace expansion)"));
            }
        }
    }
    Ok(())
}

/// The `NAME=` prefix of an unquoted first part makes a word an assignment.
fn as_assignment(word: &Word) -> Option<(String, Word)> {
    let Some(Part::Lit {
        text,
        quoted: false,
    }) = word.0.first()
    else {
        return None;
    };
    let (name, value) = text.split_once('=')?;
    if !(name.chars().next().is_some_and(is_name_start) && name.chars().all(is_name_char)) {
        return None;
    }
    let mut parts = Vec::new();
    if !value.is_empty() {
        parts.push(Part::Lit {
            text: value.to_owned(),
            quoted: false,
        });
    }
    parts.extend(word.0[1..].iter().cloned());
    Some((name.to_owned(), Word(parts)))
}

struct Parser {
    tokens: Vec<Token>,
    pos: usize,
}

fn describe(token: Option<&Token>) -> String {
    match token {
        None => "end of input".into(),
        Some(Token::And) => "'&&'".into(),
        Some(Token::Or) => "'||'".into(),
        Some(Token::Pipe) => "'|'".into(),
        Some(Token::Sep) => "';'".into(),
        Some(Token::Bang) => "'!'".into(),
        Some(Token::Redir(..)) => "a redirection".into(),
        Some(Token::Word(_)) => "a word".into(),
    }
}

impl Parser {
    fn peek(&self) -> Option<&Token> {
        self.tokens.get(self.pos)
    }

    fn skip_seps(&mut self) {
        while self.peek() == Some(&Token::Sep) {
            self.pos += 1;
        }
    }

    fn script(&mut self) -> Result<Script, ParseError> {
        let mut script = Vec::new();
        self.skip_seps();
        while self.peek().is_some() {
            script.push(self.and_or()?);
            match self.peek() {
                None => break,
                Some(Token::Sep) => self.skip_seps(),
                other => return syntax(format!("unexpected {}", describe(other))),
            }
        }
        Ok(script)
    }

    fn and_or(&mut self) -> Result<AndOr, ParseError> {
        let first = self.pipeline()?;
        let mut rest = Vec::new();
        loop {
            let connector = match self.peek() {
                Some(Token::And) => Connector::And,
                Some(Token::Or) => Connector::Or,
                _ => break,
            };
            let op = describe(self.peek());
            self.pos += 1;
            self.skip_newlines_after(&op)?;
            rest.push((connector, self.pipeline()?));
        }
        Ok(AndOr { first, rest })
    }

    /// After `&&`, `||` and `|` a command must follow (newlines may come first).
    fn skip_newlines_after(&mut self, op: &str) -> Result<(), ParseError> {
        self.skip_seps();
        if self.peek().is_none() {
            return syntax(format!("missing command after {op}"));
        }
        Ok(())
    }

    fn pipeline(&mut self) -> Result<Pipeline, ParseError> {
        let negated = if self.peek() == Some(&Token::Bang) {
            self.pos += 1;
            true
        } else {
            false
        };
        let mut commands = vec![self.command()?];
        while self.peek() == Some(&Token::Pipe) {
            self.pos += 1;
            self.skip_newlines_after("'|'")?;
            commands.push(self.command()?);
        }
        Ok(Pipeline { negated, commands })
    }

    fn command(&mut self) -> Result<Command, ParseError> {
        let mut command = Command::default();
        loop {
            match self.peek().cloned() {
                Some(Token::Word(word)) => {
                    self.pos += 1;
                    if command.words.is_empty()
                        && let Some(assignment) = as_assignment(&word)
                    {
                        command.assignments.push(assignment);
                    } else {
                        command.words.push(word);
                    }
                }
                Some(Token::Redir(fd, op)) => {
                    self.pos += 1;
                    let kind = match op {
                        RedirOp::In => RedirectKind::Input,
                        RedirOp::Out => RedirectKind::Output,
                        RedirOp::Append => RedirectKind::Append,
                        RedirOp::Dup(to) => RedirectKind::Dup(to),
                    };
                    let target = if let RedirectKind::Dup(_) = kind {
                        Word::default()
                    } else {
                        match self.peek().cloned() {
                            Some(Token::Word(word)) => {
                                self.pos += 1;
                                word
                            }
                            other => {
                                return syntax(format!(
                                    "redirection without a file name (found {})",
                                    describe(other.as_ref())
                                ));
                            }
                        }
                    };
                    command.redirects.push(Redirect { fd, kind, target });
                }
                Some(Token::Bang) => return syntax("unexpected '!'"),
                other => {
                    if command.words.is_empty()
                        && command.assignments.is_empty()
                        && command.redirects.is_empty()
                    {
                        return syntax(format!(
                            "expected a command, found {}",
                            describe(other.as_ref())
                        ));
                    }
                    return Ok(command);
                }
            }
        }
    }
}

/// Parses a whole command string; an empty or comment-only string is an empty script.
pub fn parse(source: &str) -> Result<Script, ParseError> {
    let tokens = Lexer {
        chars: source.chars().collect(),
        pos: 0,
        _src: source,
    }
    .tokens()?;
    Parser { tokens, pos: 0 }.script()
}

#[cfg(test)]
mod tests;
