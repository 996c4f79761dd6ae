//! Calico's label selector language (`rack == "r1" && zone in {"a", "b"}`): parser, evaluator over
//! a label map, and the canonical text form that parses back to the same expression.
//!
//! The grammar, tokenizer quirks and evaluation rules follow Calico's
//! `libcalico-go/lib/selector/{tokenizer,parser}` (v3.29+), so a selector Calico accepts means the
//! same here:
//!
//! - terms: `all()`, `global()`, `has(k)`, `k == "v"`, `k != "v"`, `k in {"a", "b"}`,
//!   `k not in {...}`, `k contains "s"`, `k starts with "s"`, `k ends with "s"`;
//! - `!` (binds tightest; any run of `!` collapses to one or none), `&&` (before `||`), `||`,
//!   parentheses; the empty (or blank) selector is `all()`;
//! - string literals in double or single quotes, without escapes (so one literal never holds both
//!   quote characters); label keys of `[A-Za-z0-9_./-]`; whitespace is space and tab only;
//! - a missing label never equals, is never in a set, never contains, starts or ends with anything;
//!   `!=` and `not in` are therefore true for a missing label;
//! - `global()` matches everything, as Calico's evaluator does (Calico gives it meaning only for
//!   namespaced policy objects; for nodes it is `all()`).
//!
//! Not supported from Calico: its `LabelRestrictions` analysis, the selector hash (`UniqueID`) and
//! the prefixing visitor, none of which a node selector needs.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::model::error::IpamError;

/// Deepest nesting of parentheses a selector may have: the parser is recursive, and no sensible
/// selector comes near this.
pub const MAX_SELECTOR_NESTING: usize = 64;

/// A parsed selector expression. [`Selector`] wraps one; its [`fmt::Display`] is the canonical form.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Expr {
    /// `all()`: matches every label set.
    All,
    /// `global()`: matches every label set (Calico's evaluator does the same).
    Global,
    /// `has(key)`: the label is present, whatever its value.
    Has(String),
    /// `key == "value"`.
    Equals {
        /// The label key.
        key: String,
        /// The value it must have.
        value: String,
    },
    /// `key != "value"`: true when the label is missing or has another value.
    NotEquals {
        /// The label key.
        key: String,
        /// The value it must not have.
        value: String,
    },
    /// `key contains "text"`.
    Contains {
        /// The label key.
        key: String,
        /// Text the value must contain.
        value: String,
    },
    /// `key starts with "text"`.
    StartsWith {
        /// The label key.
        key: String,
        /// Prefix the value must have.
        value: String,
    },
    /// `key ends with "text"`.
    EndsWith {
        /// The label key.
        key: String,
        /// Suffix the value must have.
        value: String,
    },
    /// `key in {"a", "b"}`: the label is present with one of the values (sorted, no duplicates).
    In {
        /// The label key.
        key: String,
        /// The allowed values.
        values: BTreeSet<String>,
    },
    /// `key not in {"a", "b"}`: true when the label is missing or has none of the values.
    NotIn {
        /// The label key.
        key: String,
        /// The forbidden values.
        values: BTreeSet<String>,
    },
    /// `!expr`.
    Not(Box<Expr>),
    /// `(a && b && ...)`, two operands or more.
    And(Vec<Expr>),
    /// `(a || b || ...)`, two operands or more.
    Or(Vec<Expr>),
}

impl Expr {
    /// Whether `labels` satisfy this expression.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        let value_of = |key: &String| labels.get(key);
        match self {
            Expr::All | Expr::Global => true,
            Expr::Has(key) => labels.contains_key(key),
            Expr::Equals { key, value } => value_of(key) == Some(value),
            Expr::NotEquals { key, value } => value_of(key) != Some(value),
            Expr::Contains { key, value } => {
                value_of(key).is_some_and(|v| v.contains(value.as_str()))
            }
            Expr::StartsWith { key, value } => {
                value_of(key).is_some_and(|v| v.starts_with(value.as_str()))
            }
            Expr::EndsWith { key, value } => {
                value_of(key).is_some_and(|v| v.ends_with(value.as_str()))
            }
            Expr::In { key, values } => value_of(key).is_some_and(|v| values.contains(v)),
            Expr::NotIn { key, values } => !value_of(key).is_some_and(|v| values.contains(v)),
            Expr::Not(operand) => !operand.matches(labels),
            Expr::And(operands) => operands.iter().all(|o| o.matches(labels)),
            Expr::Or(operands) => operands.iter().any(|o| o.matches(labels)),
        }
    }
}

/// Writes a string literal in the quote it does not contain (double quotes by preference).
fn write_literal(f: &mut fmt::Formatter<'_>, value: &str) -> fmt::Result {
    let quote = if value.contains('"') { '\'' } else { '"' };
    write!(f, "{quote}{value}{quote}")
}

fn write_set(f: &mut fmt::Formatter<'_>, values: &BTreeSet<String>) -> fmt::Result {
    f.write_str("{")?;
    for (index, value) in values.iter().enumerate() {
        if index > 0 {
            f.write_str(", ")?;
        }
        write_literal(f, value)?;
    }
    f.write_str("}")
}

fn write_joined(f: &mut fmt::Formatter<'_>, operands: &[Expr], operator: &str) -> fmt::Result {
    f.write_str("(")?;
    for (index, operand) in operands.iter().enumerate() {
        if index > 0 {
            f.write_str(operator)?;
        }
        write!(f, "{operand}")?;
    }
    f.write_str(")")
}

impl fmt::Display for Expr {
    /// Calico's canonical form (`(a == "b" && !has(c))`), except that a double negation is
    /// written `!(!x)`, which parses back to the same expression (Calico writes `!!x`, which
    /// parses to `x`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let binary = |f: &mut fmt::Formatter<'_>, key: &str, operator: &str, value: &str| {
            write!(f, "{key} {operator} ")?;
            write_literal(f, value)
        };
        match self {
            Expr::All => f.write_str("all()"),
            Expr::Global => f.write_str("global()"),
            Expr::Has(key) => write!(f, "has({key})"),
            Expr::Equals { key, value } => binary(f, key, "==", value),
            Expr::NotEquals { key, value } => binary(f, key, "!=", value),
            Expr::Contains { key, value } => binary(f, key, "contains", value),
            Expr::StartsWith { key, value } => binary(f, key, "starts with", value),
            Expr::EndsWith { key, value } => binary(f, key, "ends with", value),
            Expr::In { key, values } => {
                write!(f, "{key} in ")?;
                write_set(f, values)
            }
            Expr::NotIn { key, values } => {
                write!(f, "{key} not in ")?;
                write_set(f, values)
            }
            Expr::Not(operand) => match operand.as_ref() {
                Expr::Not(_) => write!(f, "!({operand})"),
                _ => write!(f, "!{operand}"),
            },
            Expr::And(operands) => write_joined(f, operands, " && "),
            Expr::Or(operands) => write_joined(f, operands, " || "),
        }
    }
}

/// A selector that failed to parse: where, what the parser expected there, and what it found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid selector at character {offset}: expected {expected}, found {found}")]
pub struct SelectorError {
    /// Character (not byte) offset into the selector text, from 0, of the offending token; the
    /// text's length in characters when the text ended too soon.
    pub offset: usize,
    /// What would have been valid there.
    pub expected: String,
    /// What was there instead.
    pub found: String,
}

impl From<SelectorError> for IpamError {
    fn from(error: SelectorError) -> Self {
        IpamError::InvalidArgument(error.to_string())
    }
}

/// A parsed label selector; built only by [`Selector::parse`] (or [`Selector::all`]), so its
/// [`fmt::Display`] form always parses back to an equal selector.
///
/// Serialized (serde) as its canonical text.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Selector {
    expr: Expr,
}

impl Selector {
    /// Parses Calico selector syntax; the empty or blank text is `all()`.
    ///
    /// # Errors
    /// [`SelectorError`] naming the character offset, what was expected there and what was found.
    pub fn parse(text: &str) -> Result<Selector, SelectorError> {
        let tokens = tokenize(text)?;
        let mut parser = Parser {
            text,
            tokens: &tokens,
            next: 0,
        };
        let expr = parser.parse_root()?;
        Ok(Selector { expr })
    }

    /// `all()`: selects everything (a pool's default node selector).
    pub fn all() -> Selector {
        Selector { expr: Expr::All }
    }

    /// Whether `labels` satisfy the selector.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.expr.matches(labels)
    }

    /// True for `all()` and `global()`, which select every label set: a caller can skip reading
    /// labels altogether.
    pub fn selects_everything(&self) -> bool {
        matches!(self.expr, Expr::All | Expr::Global)
    }

    /// The parsed expression.
    pub fn expr(&self) -> &Expr {
        &self.expr
    }
}

impl Default for Selector {
    fn default() -> Self {
        Selector::all()
    }
}

impl fmt::Display for Selector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.expr.fmt(f)
    }
}

impl FromStr for Selector {
    type Err = SelectorError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Selector::parse(text)
    }
}

impl Serialize for Selector {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(&self.expr)
    }
}

impl<'de> Deserialize<'de> for Selector {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        Selector::parse(&text).map_err(serde::de::Error::custom)
    }
}

// ---------------------------------------------------------------------------------------------
// Tokenizer (Calico's `tokenizer.go`, with positions)
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq, Eq)]
enum TokenKind {
    Label(String),
    Literal(String),
    LeftBrace,
    RightBrace,
    Comma,
    Equals,
    NotEquals,
    In,
    NotIn,
    Contains,
    StartsWith,
    EndsWith,
    All,
    Global,
    Has(String),
    LeftParen,
    RightParen,
    And,
    Or,
    Not,
    End,
}

impl fmt::Display for TokenKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenKind::Label(key) => write!(f, "label {key:?}"),
            TokenKind::Literal(value) => write!(f, "string {value:?}"),
            TokenKind::LeftBrace => f.write_str("\"{\""),
            TokenKind::RightBrace => f.write_str("\"}\""),
            TokenKind::Comma => f.write_str("\",\""),
            TokenKind::Equals => f.write_str("\"==\""),
            TokenKind::NotEquals => f.write_str("\"!=\""),
            TokenKind::In => f.write_str("\"in\""),
            TokenKind::NotIn => f.write_str("\"not in\""),
            TokenKind::Contains => f.write_str("\"contains\""),
            TokenKind::StartsWith => f.write_str("\"starts with\""),
            TokenKind::EndsWith => f.write_str("\"ends with\""),
            TokenKind::All => f.write_str("\"all()\""),
            TokenKind::Global => f.write_str("\"global()\""),
            TokenKind::Has(key) => write!(f, "\"has({key})\""),
            TokenKind::LeftParen => f.write_str("\"(\""),
            TokenKind::RightParen => f.write_str("\")\""),
            TokenKind::And => f.write_str("\"&&\""),
            TokenKind::Or => f.write_str("\"||\""),
            TokenKind::Not => f.write_str("\"!\""),
            TokenKind::End => f.write_str("end of input"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Token {
    kind: TokenKind,
    /// Byte offset of the token's first character.
    start: usize,
}

const OPERATOR_AFTER_LABEL: &str =
    "an operator (==, !=, in, not in, contains, starts with, ends with)";
const TERM: &str = "a label, has(...), all(), global(), \"!\" or \"(\"";

fn is_whitespace(c: char) -> bool {
    c == ' ' || c == '\t'
}

fn is_label_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '/' | '-')
}

/// Character offset of byte offset `byte` in `text`.
fn char_offset(text: &str, byte: usize) -> usize {
    text.get(..byte)
        .map_or_else(|| text.chars().count(), |head| head.chars().count())
}

/// What the text at `byte` looks like, for an error message: its next word, or "end of input".
fn describe_text(text: &str, byte: usize) -> String {
    let rest = text.get(byte..).unwrap_or("");
    let word: String = rest
        .chars()
        .take_while(|c| !is_whitespace(*c))
        .take(16)
        .collect();
    match word.chars().next() {
        None => "end of input".to_owned(),
        Some(first) if is_label_char(first) => {
            let label: String = word.chars().take_while(|c| is_label_char(*c)).collect();
            format!("{label:?}")
        }
        Some(first) => format!("{:?}", first.to_string()),
    }
}

struct Tokenizer<'a> {
    text: &'a str,
    position: usize,
    tokens: Vec<Token>,
}

impl<'a> Tokenizer<'a> {
    fn rest(&self) -> &'a str {
        self.text.get(self.position..).unwrap_or("")
    }

    fn skip_whitespace(&mut self) {
        let rest = self.rest();
        self.position += rest.len() - rest.trim_start_matches(is_whitespace).len();
    }

    fn error(&self, byte: usize, expected: &str) -> SelectorError {
        SelectorError {
            offset: char_offset(self.text, byte),
            expected: expected.to_owned(),
            found: describe_text(self.text, byte),
        }
    }

    fn push(&mut self, kind: TokenKind, start: usize, length: usize) {
        self.tokens.push(Token { kind, start });
        self.position = start + length;
    }

    /// Consumes `word` if the rest starts with it.
    fn eat(&mut self, word: &str) -> bool {
        if self.rest().starts_with(word) {
            self.position += word.len();
            true
        } else {
            false
        }
    }

    fn label_at_position(&self) -> &'a str {
        let rest = self.rest();
        let length = rest.find(|c: char| !is_label_char(c)).unwrap_or(rest.len());
        &rest[..length]
    }

    fn string_literal(&mut self, quote: char) -> Result<(), SelectorError> {
        let start = self.position;
        let body = self.rest().get(1..).unwrap_or("");
        match body.find(quote) {
            Some(length) => {
                let value = body[..length].to_owned();
                self.push(TokenKind::Literal(value), start, length + 2);
                Ok(())
            }
            None => Err(SelectorError {
                offset: char_offset(self.text, start),
                expected: format!("a string closed by {quote}"),
                found: "an unterminated string".to_owned(),
            }),
        }
    }

    /// A two-word operator whose first word was consumed: whitespace, then `second`.
    fn second_word(
        &mut self,
        start: usize,
        second: &str,
        kind: TokenKind,
    ) -> Result<(), SelectorError> {
        self.skip_whitespace();
        let here = self.position;
        if self.eat(second) {
            self.tokens.push(Token { kind, start });
            Ok(())
        } else {
            Err(self.error(here, &format!("\"{second}\"")))
        }
    }

    /// After a label only an operator may follow (Calico's rule).
    fn operator_after_label(&mut self) -> Result<(), SelectorError> {
        let start = self.position;
        if self.eat("contains") {
            self.tokens.push(Token {
                kind: TokenKind::Contains,
                start,
            });
            Ok(())
        } else if self.eat("starts") {
            self.second_word(start, "with", TokenKind::StartsWith)
        } else if self.eat("ends") {
            self.second_word(start, "with", TokenKind::EndsWith)
        } else if self.eat("not") {
            self.second_word(start, "in", TokenKind::NotIn)
        } else if self.eat("in") {
            self.tokens.push(Token {
                kind: TokenKind::In,
                start,
            });
            Ok(())
        } else {
            Err(self.error(start, OPERATOR_AFTER_LABEL))
        }
    }

    /// `has(` was consumed: a label, then `)`.
    fn has_function(&mut self, start: usize) -> Result<(), SelectorError> {
        self.skip_whitespace();
        let label = self.label_at_position();
        if label.is_empty() {
            return Err(self.error(self.position, "a label name inside has(...)"));
        }
        self.position += label.len();
        self.close_function(start, TokenKind::Has(label.to_owned()))
    }

    /// A function's arguments were consumed: `)` closes it.
    fn close_function(&mut self, start: usize, kind: TokenKind) -> Result<(), SelectorError> {
        self.skip_whitespace();
        let here = self.position;
        if self.eat(")") {
            self.tokens.push(Token { kind, start });
            Ok(())
        } else {
            Err(self.error(here, "\")\""))
        }
    }

    fn next_token(&mut self) -> Result<(), SelectorError> {
        let start = self.position;
        let rest = self.rest();
        let mut chars = rest.chars();
        let (first, second) = (chars.next(), chars.next());
        let after_label = matches!(
            self.tokens.last(),
            Some(Token {
                kind: TokenKind::Label(_),
                ..
            })
        );
        match (first, second) {
            (Some('('), _) => self.push(TokenKind::LeftParen, start, 1),
            (Some(')'), _) => self.push(TokenKind::RightParen, start, 1),
            (Some(quote @ ('"' | '\'')), _) => self.string_literal(quote)?,
            (Some('{'), _) => self.push(TokenKind::LeftBrace, start, 1),
            (Some('}'), _) => self.push(TokenKind::RightBrace, start, 1),
            (Some(','), _) => self.push(TokenKind::Comma, start, 1),
            (Some('='), Some('=')) => self.push(TokenKind::Equals, start, 2),
            (Some('='), _) => return Err(self.error(start, "\"==\"")),
            (Some('!'), Some('=')) => self.push(TokenKind::NotEquals, start, 2),
            (Some('!'), _) => self.push(TokenKind::Not, start, 1),
            (Some('&'), Some('&')) => self.push(TokenKind::And, start, 2),
            (Some('&'), _) => return Err(self.error(start, "\"&&\"")),
            (Some('|'), Some('|')) => self.push(TokenKind::Or, start, 2),
            (Some('|'), _) => return Err(self.error(start, "\"||\"")),
            _ if after_label => self.operator_after_label()?,
            _ if self.eat("has(") => self.has_function(start)?,
            _ if self.eat("all(") => self.close_function(start, TokenKind::All)?,
            _ if self.eat("global(") => self.close_function(start, TokenKind::Global)?,
            _ => {
                let label = self.label_at_position();
                if label.is_empty() {
                    return Err(self.error(start, TERM));
                }
                self.push(TokenKind::Label(label.to_owned()), start, label.len());
            }
        }
        Ok(())
    }
}

fn tokenize(text: &str) -> Result<Vec<Token>, SelectorError> {
    let mut tokenizer = Tokenizer {
        text,
        position: 0,
        tokens: Vec::new(),
    };
    loop {
        tokenizer.skip_whitespace();
        if tokenizer.rest().is_empty() {
            tokenizer.tokens.push(Token {
                kind: TokenKind::End,
                start: text.len(),
            });
            return Ok(tokenizer.tokens);
        }
        tokenizer.next_token()?;
    }
}

// ---------------------------------------------------------------------------------------------
// Parser (Calico's `parser.go`: `||` over `&&` over possibly negated operations)
// ---------------------------------------------------------------------------------------------

struct Parser<'a> {
    text: &'a str,
    tokens: &'a [Token],
    next: usize,
}

const END_TOKEN: Token = Token {
    kind: TokenKind::End,
    start: 0,
};

impl Parser<'_> {
    fn peek(&self) -> &Token {
        self.tokens.get(self.next).unwrap_or(&END_TOKEN)
    }

    fn advance(&mut self) -> Token {
        let token = self.peek().clone();
        if self.next < self.tokens.len() {
            self.next += 1;
        }
        token
    }

    fn error_at(&self, token: &Token, expected: &str) -> SelectorError {
        let start = if token.kind == TokenKind::End {
            self.text.len()
        } else {
            token.start
        };
        SelectorError {
            offset: char_offset(self.text, start),
            expected: expected.to_owned(),
            found: token.kind.to_string(),
        }
    }

    fn parse_root(&mut self) -> Result<Expr, SelectorError> {
        if self.peek().kind == TokenKind::End {
            return Ok(Expr::All);
        }
        let expr = self.parse_or(0)?;
        let token = self.peek();
        if token.kind != TokenKind::End {
            return Err(self.error_at(token, "\"&&\", \"||\" or the end of the selector"));
        }
        Ok(expr)
    }

    fn parse_or(&mut self, depth: usize) -> Result<Expr, SelectorError> {
        let mut operands = vec![self.parse_and(depth)?];
        while self.peek().kind == TokenKind::Or {
            self.advance();
            operands.push(self.parse_and(depth)?);
        }
        Ok(if operands.len() == 1 {
            operands.remove(0)
        } else {
            Expr::Or(operands)
        })
    }

    fn parse_and(&mut self, depth: usize) -> Result<Expr, SelectorError> {
        let mut operands = vec![self.parse_operation(depth)?];
        while self.peek().kind == TokenKind::And {
            self.advance();
            operands.push(self.parse_operation(depth)?);
        }
        Ok(if operands.len() == 1 {
            operands.remove(0)
        } else {
            Expr::And(operands)
        })
    }

    fn expect_literal(&mut self) -> Result<String, SelectorError> {
        let token = self.advance();
        match token.kind {
            TokenKind::Literal(value) => Ok(value),
            _ => Err(self.error_at(&token, "a quoted string")),
        }
    }

    fn parse_set(&mut self) -> Result<BTreeSet<String>, SelectorError> {
        let brace = self.advance();
        if brace.kind != TokenKind::LeftBrace {
            return Err(self.error_at(&brace, "a set of strings in braces, like {\"a\", \"b\"}"));
        }
        let mut values = BTreeSet::new();
        let mut after_value = false;
        // As Calico: strings separated by commas; a trailing comma is allowed, `{}` is empty.
        loop {
            let token = self.advance();
            match token.kind {
                TokenKind::Literal(value) if !after_value => {
                    values.insert(value);
                    after_value = true;
                }
                TokenKind::Comma if after_value => after_value = false,
                TokenKind::RightBrace => return Ok(values),
                _ => {
                    let expected = if after_value {
                        "\",\" or \"}\""
                    } else {
                        "a quoted string or \"}\""
                    };
                    return Err(self.error_at(&token, expected));
                }
            }
        }
    }

    fn parse_operation(&mut self, depth: usize) -> Result<Expr, SelectorError> {
        let mut negated = false;
        while self.peek().kind == TokenKind::Not {
            self.advance();
            negated = !negated;
        }
        let token = self.advance();
        let expr = match token.kind {
            TokenKind::Has(key) => Expr::Has(key),
            TokenKind::All => Expr::All,
            TokenKind::Global => Expr::Global,
            TokenKind::Label(key) => {
                let operator = self.advance();
                match operator.kind {
                    TokenKind::Equals => Expr::Equals {
                        key,
                        value: self.expect_literal()?,
                    },
                    TokenKind::NotEquals => Expr::NotEquals {
                        key,
                        value: self.expect_literal()?,
                    },
                    TokenKind::Contains => Expr::Contains {
                        key,
                        value: self.expect_literal()?,
                    },
                    TokenKind::StartsWith => Expr::StartsWith {
                        key,
                        value: self.expect_literal()?,
                    },
                    TokenKind::EndsWith => Expr::EndsWith {
                        key,
                        value: self.expect_literal()?,
                    },
                    TokenKind::In => Expr::In {
                        key,
                        values: self.parse_set()?,
                    },
                    TokenKind::NotIn => Expr::NotIn {
                        key,
                        values: self.parse_set()?,
                    },
                    _ => return Err(self.error_at(&operator, OPERATOR_AFTER_LABEL)),
                }
            }
            TokenKind::LeftParen => {
                if depth >= MAX_SELECTOR_NESTING {
                    return Err(SelectorError {
                        offset: char_offset(self.text, token.start),
                        expected: format!("at most {MAX_SELECTOR_NESTING} nested parentheses"),
                        found: "one more".to_owned(),
                    });
                }
                let inner = self.parse_or(depth + 1)?;
                let closing = self.advance();
                if closing.kind != TokenKind::RightParen {
                    return Err(self.error_at(&closing, "\"&&\", \"||\" or \")\""));
                }
                inner
            }
            _ => return Err(self.error_at(&token, TERM)),
        };
        Ok(if negated {
            Expr::Not(Box::new(expr))
        } else {
            expr
        })
    }
}

#[cfg(test)]
mod tests;
