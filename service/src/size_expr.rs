//! Size expressions over `ram`: zram-generator's `zram-size`/`zram-resident-limit` language, and
//! the same with explicit units for uzram's own configuration.
//!
//! One parser, two [`Units`]:
//!
//! - [`Units::GeneratorMib`]: zram-generator's (its `fasteval` language): every value is a
//!   float, `ram` is MemTotal in MiB (whole MiB, as zram-generator truncates it) and the result
//!   is MiB. Numbers take fasteval's decimal suffixes (`n µ/u m K M G T`: 1e-9 .. 1e12). Besides
//!   `+ - * / % ^` (`^` right-associative), parentheses and square brackets, it has
//!   comparisons (`< <= == != >= >`, 1 or 0), `&&`/`||` (fasteval's: the deciding operand's
//!   value) and unary `!`, and the functions `min`/`max` (one or more arguments), `int`, `ceil`,
//!   `floor`, `abs`, `sign`, `round([modulus,] x)`, `log([base,] x)` (base 10 by default),
//!   `e()`, `pi()`, and `sin cos tan asin acos atan sinh cosh tanh asinh acosh atanh`. fasteval's
//!   `print` is not there.
//! - [`Units::Bytes`]: uzram's `disksize`: `ram` is MemTotal in bytes and a number with a unit
//!   takes zram's `memparse` suffixes (`K M G T P E`, powers of 1024, either case). Values carry
//!   a dimension: `ram` and numbers with a unit are sizes, numbers without one are plain
//!   factors. A size may be added to or compared with a size, multiplied or divided by a
//!   factor, and divided by a size (giving a factor); `min`/`max` take sizes. So
//!   `min(ram / 2, 4096M)` and `ram * 0.5` are sizes, and zram-generator's
//!   `min(ram / 2, 4096)` is an error that says to write `4096M` rather than 4096 bytes. A
//!   whole expression that is one plain number is bytes (`disksize = 1073741824`).
//!
//! Evaluation errors name the expression and what is wrong; a negative or non-finite result
//! is an error too.

use uzram::error::{Error, ErrorKind, Result};

/// Which language (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Units {
    /// zram-generator's: floats in MiB, decimal suffixes.
    GeneratorMib,
    /// uzram's: sizes in bytes with memparse units, checked dimensions.
    Bytes,
}

/// A value: a number and, in [`Units::Bytes`], whether it is a size.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Value {
    v: f64,
    size: bool,
}

impl Value {
    fn plain(v: f64) -> Value {
        Value { v, size: false }
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Token {
    /// A number, and whether it carried a unit suffix (Bytes) .
    Num(f64, bool),
    Ident(String),
    Op(&'static str),
    Open,
    Close,
    Comma,
}

/// Binary operators, loosest first, as fasteval ranks them.
const LEVELS: &[&[&str]] = &[
    &["||"],
    &["&&"],
    &["==", "!=", "<=", ">=", "<", ">"],
    &["+", "-"],
    &["*", "/", "%"],
];

struct Parser<'a> {
    expr: &'a str,
    tokens: Vec<Token>,
    pos: usize,
    units: Units,
    vars: &'a dyn Fn(&str) -> Option<f64>,
}

fn err(expr: &str, msg: impl std::fmt::Display) -> Error {
    Error::invalid(format!("{expr:?}: {msg}"))
}

fn tokenize(expr: &str, units: Units) -> Result<Vec<Token>> {
    let b: Vec<char> = expr.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c.is_whitespace() {
            i += 1;
            continue;
        }
        if c.is_ascii_digit() || (c == '.' && b.get(i + 1).is_some_and(|d| d.is_ascii_digit())) {
            let start = i;
            while i < b.len() && (b[i].is_ascii_digit() || b[i] == '.') {
                i += 1;
            }
            // An exponent: 1e3, 2.5E-2.
            if i < b.len()
                && (b[i] == 'e' || b[i] == 'E')
                && (b.get(i + 1).is_some_and(|d| d.is_ascii_digit())
                    || (matches!(b.get(i + 1), Some('+' | '-'))
                        && b.get(i + 2).is_some_and(|d| d.is_ascii_digit())))
            {
                i += 2;
                while i < b.len() && b[i].is_ascii_digit() {
                    i += 1;
                }
            }
            let text: String = b[start..i].iter().collect();
            let mut v: f64 = text
                .parse()
                .map_err(|_| err(expr, format!("{text:?} is not a number")))?;
            let mut unit = false;
            // A suffix letter directly after the number, not the start of a name.
            let suffix = b.get(i).copied();
            let next_is_name = b
                .get(i + 1)
                .is_some_and(|c| c.is_alphanumeric() || *c == '_');
            if let Some(s) = suffix.filter(|_| !next_is_name) {
                let factor = match units {
                    Units::GeneratorMib => match s {
                        'n' => Some(1e-9),
                        'µ' | 'u' => Some(1e-6),
                        'm' => Some(1e-3),
                        'K' | 'k' => Some(1e3),
                        'M' => Some(1e6),
                        'G' => Some(1e9),
                        'T' => Some(1e12),
                        _ => None,
                    },
                    Units::Bytes => match s.to_ascii_uppercase() {
                        'K' => Some(1024f64),
                        'M' => Some(1024f64.powi(2)),
                        'G' => Some(1024f64.powi(3)),
                        'T' => Some(1024f64.powi(4)),
                        'P' => Some(1024f64.powi(5)),
                        'E' => Some(1024f64.powi(6)),
                        _ => None,
                    },
                };
                if let Some(f) = factor {
                    v *= f;
                    unit = true;
                    i += 1;
                }
            }
            if b.get(i).is_some_and(|c| c.is_alphanumeric() || *c == '_') {
                return Err(err(
                    expr,
                    format!(
                        "bad number or unit at {:?}",
                        b[start..].iter().collect::<String>()
                    ),
                ));
            }
            out.push(Token::Num(v, unit));
            continue;
        }
        if c.is_alphabetic() || c == '_' {
            let start = i;
            while i < b.len() && (b[i].is_alphanumeric() || b[i] == '_') {
                i += 1;
            }
            out.push(Token::Ident(b[start..i].iter().collect()));
            continue;
        }
        let two: String = b[i..(i + 2).min(b.len())].iter().collect();
        let op2 = ["||", "&&", "==", "!=", "<=", ">="]
            .into_iter()
            .find(|o| *o == two);
        if let Some(o) = op2 {
            out.push(Token::Op(o));
            i += 2;
            continue;
        }
        let tok = match c {
            '(' | '[' => Token::Open,
            ')' | ']' => Token::Close,
            ',' => Token::Comma,
            '+' => Token::Op("+"),
            '-' => Token::Op("-"),
            '*' => Token::Op("*"),
            '/' => Token::Op("/"),
            '%' => Token::Op("%"),
            '^' => Token::Op("^"),
            '<' => Token::Op("<"),
            '>' => Token::Op(">"),
            '!' => Token::Op("!"),
            _ => return Err(err(expr, format!("unexpected {c:?}"))),
        };
        out.push(tok);
        i += 1;
    }
    Ok(out)
}

impl Parser<'_> {
    fn peek(&self) -> Option<&Token> {
        self.tokens.get(self.pos)
    }

    fn bytes(&self) -> bool {
        self.units == Units::Bytes
    }

    fn expr(&mut self, level: usize) -> Result<Value> {
        if level == LEVELS.len() {
            return self.power();
        }
        let mut left = self.expr(level + 1)?;
        while let Some(Token::Op(op)) = self.peek() {
            let op = *op;
            if !LEVELS[level].contains(&op) {
                break;
            }
            self.pos += 1;
            let right = self.expr(level + 1)?;
            left = self.binary(op, left, right)?;
        }
        Ok(left)
    }

    /// `^`, right-associative, binding tighter than unary minus on its left as fasteval's
    /// (`-2^2` is -4).
    fn power(&mut self) -> Result<Value> {
        let base = self.unary()?;
        if self.peek() == Some(&Token::Op("^")) {
            self.pos += 1;
            let exp = self.power()?;
            return self.binary("^", base, exp);
        }
        Ok(base)
    }

    fn unary(&mut self) -> Result<Value> {
        match self.peek() {
            Some(Token::Op("-")) => {
                self.pos += 1;
                let v = self.power()?;
                Ok(Value { v: -v.v, ..v })
            }
            Some(Token::Op("+")) => {
                self.pos += 1;
                self.power()
            }
            Some(Token::Op("!")) => {
                self.pos += 1;
                let v = self.power()?;
                if v.size {
                    return Err(err(self.expr, "`!` of a size"));
                }
                Ok(Value::plain(if v.v == 0.0 { 1.0 } else { 0.0 }))
            }
            _ => self.atom(),
        }
    }

    fn args(&mut self, name: &str) -> Result<Vec<Value>> {
        if self.peek() != Some(&Token::Open) {
            return Err(err(self.expr, format!("{name} needs (arguments)")));
        }
        self.pos += 1;
        let mut args = Vec::new();
        if self.peek() == Some(&Token::Close) {
            self.pos += 1;
            return Ok(args);
        }
        loop {
            args.push(self.expr(0)?);
            match self.peek() {
                Some(Token::Comma) => self.pos += 1,
                Some(Token::Close) => {
                    self.pos += 1;
                    return Ok(args);
                }
                _ => return Err(err(self.expr, format!("{name}(: expected , or )"))),
            }
        }
    }

    fn atom(&mut self) -> Result<Value> {
        let tok = self
            .peek()
            .cloned()
            .ok_or_else(|| err(self.expr, "ends where a value should be"))?;
        self.pos += 1;
        match tok {
            Token::Num(v, unit) => Ok(Value {
                v,
                size: unit && self.bytes(),
            }),
            Token::Open => {
                let v = self.expr(0)?;
                if self.peek() != Some(&Token::Close) {
                    return Err(err(self.expr, "unbalanced parenthesis"));
                }
                self.pos += 1;
                Ok(v)
            }
            Token::Ident(name) => {
                if self.peek() == Some(&Token::Open) {
                    let args = self.args(&name)?;
                    return self.call(&name, &args);
                }
                match (self.vars)(&name) {
                    Some(v) => Ok(Value {
                        v,
                        size: self.bytes(),
                    }),
                    None => Err(err(self.expr, format!("unknown name {name:?}"))),
                }
            }
            t => Err(err(self.expr, format!("unexpected {t:?}"))),
        }
    }

    fn call(&self, name: &str, args: &[Value]) -> Result<Value> {
        let e = self.expr;
        let n = args.len();
        let want = |lo: usize, hi: usize| {
            if n < lo || n > hi {
                Err(err(
                    e,
                    format!("{name}() takes {lo}..={hi} arguments, not {n}"),
                ))
            } else {
                Ok(())
            }
        };
        let plain_args = || {
            if args.iter().any(|a| a.size) {
                Err(err(e, format!("{name}() of a size")))
            } else {
                Ok(())
            }
        };
        match name {
            "min" | "max" => {
                if n == 0 {
                    return Err(err(e, format!("{name}() needs an argument")));
                }
                if args.iter().any(|a| a.size != args[0].size) {
                    return Err(self.unit_error(name, args));
                }
                let pick = if name == "min" { f64::min } else { f64::max };
                Ok(Value {
                    v: args.iter().map(|a| a.v).fold(args[0].v, pick),
                    size: args[0].size,
                })
            }
            "int" | "ceil" | "floor" | "abs" | "sign" => {
                want(1, 1)?;
                let a = args[0];
                let v = match name {
                    "int" => a.v.trunc(),
                    "ceil" => a.v.ceil(),
                    "floor" => a.v.floor(),
                    "abs" => a.v.abs(),
                    _ => {
                        if a.v == 0.0 {
                            0.0
                        } else {
                            a.v.signum()
                        }
                    }
                };
                Ok(Value {
                    v,
                    size: a.size && name != "sign",
                })
            }
            "round" => {
                want(1, 2)?;
                let (m, x) = if n == 2 {
                    (args[0], args[1])
                } else {
                    (
                        Value {
                            v: 1.0,
                            size: args[0].size,
                        },
                        args[0],
                    )
                };
                if m.size != x.size && n == 2 {
                    return Err(self.unit_error(name, args));
                }
                Ok(Value {
                    v: (x.v / m.v).round() * m.v,
                    size: x.size,
                })
            }
            "log" => {
                want(1, 2)?;
                plain_args()?;
                let (base, x) = if n == 2 {
                    (args[0].v, args[1].v)
                } else {
                    (10.0, args[0].v)
                };
                // Exact for the usual bases (ln(1000) / ln(10) is 2.9999999999999996).
                let v = if base == 10.0 {
                    x.log10()
                } else if base == 2.0 {
                    x.log2()
                } else {
                    x.log(base)
                };
                Ok(Value::plain(v))
            }
            "e" | "pi" => {
                want(0, 0)?;
                Ok(Value::plain(if name == "e" {
                    std::f64::consts::E
                } else {
                    std::f64::consts::PI
                }))
            }
            "sin" | "cos" | "tan" | "asin" | "acos" | "atan" | "sinh" | "cosh" | "tanh"
            | "asinh" | "acosh" | "atanh" => {
                want(1, 1)?;
                plain_args()?;
                let x = args[0].v;
                Ok(Value::plain(match name {
                    "sin" => x.sin(),
                    "cos" => x.cos(),
                    "tan" => x.tan(),
                    "asin" => x.asin(),
                    "acos" => x.acos(),
                    "atan" => x.atan(),
                    "sinh" => x.sinh(),
                    "cosh" => x.cosh(),
                    "tanh" => x.tanh(),
                    "asinh" => x.asinh(),
                    "acosh" => x.acosh(),
                    _ => x.atanh(),
                }))
            }
            _ => Err(err(e, format!("unknown function {name}()"))),
        }
    }

    /// The error for mixing sizes with plain numbers, suggesting a unit.
    fn unit_error(&self, what: &str, args: &[Value]) -> Error {
        let plain = args.iter().find(|a| !a.size).map(|a| a.v).unwrap_or(0.0);
        err(
            self.expr,
            format!(
                "{what} mixes a size with the plain number {plain}: give it a unit (`{plain}M` \
                 for MiB, as zram-generator's sizes are) or write bytes as a size (`{plain}K`...)"
            ),
        )
    }

    fn binary(&self, op: &str, a: Value, b: Value) -> Result<Value> {
        let e = self.expr;
        let size = match (op, a.size, b.size) {
            (_, false, false) => false,
            ("+" | "-" | "%", true, true) => true,
            ("==" | "!=" | "<" | "<=" | ">" | ">=", true, true) => false,
            ("*", true, false) | ("*", false, true) | ("/", true, false) => true,
            ("/", true, true) => false,
            ("+" | "-" | "%" | "==" | "!=" | "<" | "<=" | ">" | ">=", _, _) => {
                return Err(self.unit_error(&format!("`{op}`"), &[a, b]))
            }
            _ => return Err(err(e, format!("`{op}` of sizes has no meaning here"))),
        };
        let t = |c: bool| if c { 1.0 } else { 0.0 };
        let v = match op {
            "+" => a.v + b.v,
            "-" => a.v - b.v,
            "*" => a.v * b.v,
            "/" => a.v / b.v,
            "%" => a.v % b.v,
            "^" => a.v.powf(b.v),
            "==" => t(a.v == b.v),
            "!=" => t(a.v != b.v),
            "<" => t(a.v < b.v),
            "<=" => t(a.v <= b.v),
            ">" => t(a.v > b.v),
            ">=" => t(a.v >= b.v),
            // fasteval's: the operand that decides.
            "&&" => {
                if a.v == 0.0 {
                    a.v
                } else {
                    b.v
                }
            }
            _ => {
                if a.v != 0.0 {
                    a.v
                } else {
                    b.v
                }
            }
        };
        Ok(Value { v, size })
    }
}

/// Evaluates `expr` with the variables `vars` gives (`ram`, and zram-generator's `set!`
/// names), in `units`. The result: MiB for [`Units::GeneratorMib`], bytes for
/// [`Units::Bytes`]; finite and not negative.
pub fn eval(expr: &str, units: Units, vars: &dyn Fn(&str) -> Option<f64>) -> Result<f64> {
    let v = eval_signed(expr, units, vars)?;
    if v < 0.0 {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!("{expr:?}: evaluates to {v} < 0"),
        ));
    }
    Ok(v)
}

/// As [`eval`], with negative results allowed (zram-generator's `set!` variables).
pub fn eval_signed(expr: &str, units: Units, vars: &dyn Fn(&str) -> Option<f64>) -> Result<f64> {
    let tokens = tokenize(expr, units)?;
    if tokens.is_empty() {
        return Err(err(expr, "empty expression"));
    }
    let mut p = Parser {
        expr,
        tokens,
        pos: 0,
        units,
        vars,
    };
    let v = p.expr(0)?;
    if p.pos != p.tokens.len() {
        return Err(err(expr, format!("unexpected {:?}", p.tokens[p.pos])));
    }
    if units == Units::Bytes && !v.size && p.tokens.len() > 1 {
        return Err(err(
            expr,
            "the result is a plain number, not a size: give a unit (`4096M`) or use `ram`",
        ));
    }
    if !v.v.is_finite() {
        return Err(err(expr, format!("evaluates to {}", v.v)));
    }
    Ok(v.v)
}

/// uzram's size in bytes: `expr` in [`Units::Bytes`] with `ram` = `ram_bytes`, rounded down to
/// a whole byte.
pub fn eval_bytes(expr: &str, ram_bytes: u64) -> Result<u64> {
    // A plain size exactly as zram's `disksize` takes it (hex, exact above 2^53).
    if let Ok(n) = uzram::units::parse_size_bytes(expr) {
        return Ok(n);
    }
    let ram = ram_bytes as f64;
    let v = eval(expr, Units::Bytes, &|n| (n == "ram").then_some(ram))?;
    if v >= u64::MAX as f64 {
        return Err(Error::new(
            ErrorKind::OutOfRange,
            format!("{expr:?} overflows"),
        ));
    }
    Ok(v as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 1 << 30;

    fn mib(expr: &str, ram_mib: f64) -> f64 {
        eval(expr, Units::GeneratorMib, &|n| {
            (n == "ram").then_some(ram_mib)
        })
        .unwrap()
    }

    #[test]
    fn zram_generators_language() {
        assert_eq!(mib("min(ram / 2, 4096)", 16000.0), 4096.0);
        assert_eq!(mib("min(ram / 2, 4096)", 2000.0), 1000.0);
        assert_eq!(mib("ram / 10", 1000.0), 100.0);
        assert_eq!(mib("ram * 0.5", 1000.0), 500.0);
        // The manual's piecewise-linear example.
        let piecewise = "min(min(ram, 4096) + max(ram - 4096, 0) / 2, 32 * 1024)";
        assert_eq!(mib(piecewise, 1024.0), 1024.0);
        assert_eq!(mib(piecewise, 8192.0), 6144.0);
        assert_eq!(mib(piecewise, 65536.0), 32768.0);
        assert_eq!(mib("2^3^2", 0.0), 512.0);
        assert_eq!(mib("8 + -2^2", 0.0), 4.0);
        assert_eq!(mib("7 % 4 + 1K", 0.0), 1003.0);
        assert_eq!(mib("[1 + 2] * 3", 0.0), 9.0);
        assert_eq!(mib("int(2.7) + ceil(0.2) + floor(1.9) + abs(-1)", 0.0), 5.0);
        assert_eq!(mib("round(2.5) + round(10, 27)", 0.0), 33.0);
        assert_eq!(mib("log(1000) + log(2, 8)", 0.0), 6.0);
        assert!((mib("pi() + e()", 0.0) - 5.859874482).abs() < 1e-6);
        assert_eq!(mib("max(1, 2, 3) + (2 < 3) + (1 && 5)", 0.0), 9.0);
        assert_eq!(mib("1.5e3 + 2M / 1M", 0.0), 1502.0);
        assert_eq!(mib("sin(0) + cos(0)", 0.0), 1.0);
    }

    #[test]
    fn zram_generators_errors() {
        let bad =
            |e: &str| eval(e, Units::GeneratorMib, &|n| (n == "ram").then_some(100.0)).unwrap_err();
        for e in [
            "", "ram /", "min(", "ram ram", "foo", "bar(1)", "1 $ 2", "(1", "1)",
        ] {
            assert_eq!(bad(e).kind(), ErrorKind::InvalidArgument, "{e:?}");
        }
        assert!(bad("ram - 200").message().contains("< 0"));
        assert!(bad("1 / 0").message().contains("inf"));
        assert!(bad("log()").message().contains("arguments"));
    }

    #[test]
    fn uzram_sizes_need_units() {
        assert_eq!(eval_bytes("ram * 0.5", 16 * G).unwrap(), 8 * G);
        assert_eq!(eval_bytes("min(ram / 2, 4096M)", 16 * G).unwrap(), 4 * G);
        assert_eq!(eval_bytes("min(ram / 2, 4G)", 2 * G).unwrap(), G);
        assert_eq!(eval_bytes("4G", 0).unwrap(), 4 * G);
        assert_eq!(eval_bytes("1073741824", 0).unwrap(), G);
        assert_eq!(eval_bytes("0x1000", 0).unwrap(), 4096);
        assert_eq!(eval_bytes("512k + 512K", 0).unwrap(), 1 << 20);
        assert_eq!(eval_bytes("ram * 3 / 4", 16 * G).unwrap(), 12 * G);
        assert_eq!(eval_bytes("max(min(ram, 1G), 2G)", 16 * G).unwrap(), 2 * G);
        assert_eq!(eval_bytes("ram / (ram / 1M)", 16 * G).unwrap(), 1 << 20);
        let e = eval_bytes("min(ram / 2, 4096)", G).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert!(e.message().contains("4096M"), "{e}");
        for bad in [
            "ram + 1",
            "ram * ram",
            "2 * 3",
            "1G * ram / ram",
            "sin(ram)",
            "ram / 0",
            "12Q",
            "",
        ] {
            assert!(eval_bytes(bad, G).is_err(), "{bad:?}");
        }
    }
}
