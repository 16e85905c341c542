//! The constants every layer shares, and the kernel's parsers of attribute values: sizes with
//! zram's suffixes (`memparse`), `kstrtoull`, `kstrtobool`.

use crate::error::{Error, ErrorKind, Result};

/// The block layer's sector: the unit of I/O alignment (`offset` and `len` of every request are
/// multiples of it), as in the kernel, and the smallest logical block size a Linux block device
/// has (so the granularity of backing I/O and of its buffers too).
pub const SECTOR_SIZE_BYTES: usize = 512;

/// Page sizes a device may be created with (the kernel's 4 KiB, 16 KiB and 64 KiB pages).
pub const SUPPORTED_PAGE_SIZES_BYTES: [usize; 3] = [4096, 16384, 65536];

/// The default page size.
pub const DEFAULT_PAGE_SIZE_BYTES: usize = 4096;

/// A 4 KiB block: the backing layer's unit (every backing's size is a multiple of it, and
/// writes are aligned to it), and the unit zram counts `bd_stat` and `writeback_limit` in ("4K
/// units"), whatever the page size.
pub const BLOCK_SIZE_BYTES: usize = 4096;

/// [`BLOCK_SIZE_BYTES`] units per page of `page_size_bytes` (a 16 KiB page counts 4).
pub fn units_per_page(page_size_bytes: usize) -> u64 {
    (page_size_bytes / BLOCK_SIZE_BYTES) as u64
}

/// The value with at most one trailing newline removed (what sysfs handlers see as the text).
pub(crate) fn strip_newline(value: &str) -> &str {
    value.strip_suffix('\n').unwrap_or(value)
}

/// The kernel's `kstrtoull`: optional `+`, digits in `radix` (0: auto-detect `0x` hex or a
/// leading `0` octal), an optional trailing newline, nothing else. Overflow is `ERANGE`.
pub fn kstrtou64(value: &str, radix: u32) -> Result<u64> {
    let v = strip_newline(value);
    let v = v.strip_prefix('+').unwrap_or(v);
    let (digits, radix) = match radix {
        0 => {
            if let Some(rest) = v.strip_prefix("0x").or_else(|| v.strip_prefix("0X")) {
                (rest, 16)
            } else if v.len() > 1 && v.starts_with('0') {
                (&v[1..], 8)
            } else {
                (v, 10)
            }
        }
        r => (v, r),
    };
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
        return Err(Error::invalid(format!("not a number: {value:?}")));
    }
    u64::from_str_radix(digits, radix).map_err(|_| {
        Error::new(
            ErrorKind::OutOfRange,
            format!("number too large: {value:?}"),
        )
    })
}

/// The kernel's `kstrtoint`: an optional sign (`+` or `-`), then digits in `radix` (as
/// [`kstrtou64`]), one trailing newline allowed; `EINVAL` if malformed, `ERANGE` outside `int`.
pub fn kstrtoint(value: &str, radix: u32) -> Result<i32> {
    let v = strip_newline(value);
    let (negative, digits) = match v.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, v.strip_prefix('+').unwrap_or(v)),
    };
    if digits.starts_with(['+', '-']) || digits.contains('\n') {
        return Err(Error::invalid(format!("not a number: {value:?}")));
    }
    let magnitude = kstrtou64(digits, radix)
        .map_err(|e| Error::new(e.kind(), format!("{} ({value:?})", e.message())))?;
    let n = if negative {
        -i128::from(magnitude)
    } else {
        i128::from(magnitude)
    };
    i32::try_from(n).map_err(|_| {
        Error::new(
            ErrorKind::OutOfRange,
            format!("number out of range: {value:?}"),
        )
    })
}

/// The kernel's `kstrtobool`: `1`/`y`/`Y`/`t`/`T`/`on` are true, `0`/`n`/`N`/`f`/`F`/`off`
/// false (only the first one or two characters count), anything else `EINVAL`.
pub fn kstrtobool(value: &str) -> Result<bool> {
    let b = strip_newline(value).as_bytes();
    match b {
        [b'1' | b'y' | b'Y' | b't' | b'T', ..] => Ok(true),
        [b'0' | b'n' | b'N' | b'f' | b'F', ..] => Ok(false),
        [b'o' | b'O', b'n' | b'N', ..] => Ok(true),
        [b'o' | b'O', b'f' | b'F', ..] => Ok(false),
        _ => Err(Error::invalid(format!("not a boolean: {value:?}"))),
    }
}

/// The kernel's `memparse()` exactly, as zram's `disksize` and `mem_limit` parse their value:
/// `simple_strtoull(text, 0)` (a `0x` prefix followed by a hex digit is hex, another leading
/// `0` octal, else decimal; no sign, no leading blanks), then one optional suffix `K M G T P E`
/// (either case) shifting by 10 per step as the kernel's fall-through does (bits shifted past
/// 64 are lost), and whatever follows is ignored (`12 MB` is 12 bytes, `1.5G` is 1 byte).
/// Nothing parsed gives 0, which `disksize` refuses as the kernel does; `EINVAL` only where
/// the kernel's conversion would overflow (it silently wraps there).
pub fn memparse(text: &str) -> Result<u64> {
    let b = text.as_bytes();
    let (radix, start) = match b {
        [b'0', b'x' | b'X', c, ..] if c.is_ascii_hexdigit() => (16, 2),
        [b'0', ..] => (8, 1),
        _ => (10, 0),
    };
    let digits = b[start..]
        .iter()
        .take_while(|c| (**c as char).is_digit(radix))
        .count();
    if digits == 0 {
        // Nothing parsed, or a lone `0` (whatever follows it, the value is 0).
        return Ok(0);
    }
    let num = std::str::from_utf8(&b[start..start + digits]).expect("ASCII digits");
    let value = u64::from_str_radix(num, radix)
        .map_err(|_| Error::invalid(format!("size out of range: {text:?}")))?;
    let shift = match b.get(start + digits).map(u8::to_ascii_lowercase) {
        Some(b'e') => 60,
        Some(b'p') => 50,
        Some(b't') => 40,
        Some(b'g') => 30,
        Some(b'm') => 20,
        Some(b'k') => 10,
        _ => 0,
    };
    Ok(((u128::from(value) << shift) & u128::from(u64::MAX)) as u64)
}

/// Parses a size as uzram's own settings and configuration take it: [`memparse`]'s numbers and
/// suffixes, but strict: surrounding whitespace and a trailing newline are ignored, anything
/// else after the suffix is `EINVAL`.
pub fn parse_size_bytes(text: &str) -> Result<u64> {
    let t = text.trim();
    if t.is_empty() {
        return Err(Error::invalid("empty size"));
    }
    let (digits, radix) = match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(rest) => (rest, 16),
        None => (t, 10),
    };
    let end = digits
        .find(|c: char| !c.is_digit(radix))
        .unwrap_or(digits.len());
    let (num, suffix) = digits.split_at(end);
    if num.is_empty() {
        return Err(Error::invalid(format!("not a size: {t:?}")));
    }
    let value = u64::from_str_radix(num, radix)
        .map_err(|_| Error::invalid(format!("size out of range: {t:?}")))?;
    let shift = match suffix {
        "" => 0,
        "k" | "K" => 10,
        "m" | "M" => 20,
        "g" | "G" => 30,
        "t" | "T" => 40,
        "p" | "P" => 50,
        "e" | "E" => 60,
        _ => return Err(Error::invalid(format!("bad size suffix in {t:?}"))),
    };
    value
        .checked_mul(1u64 << shift)
        .ok_or_else(|| Error::invalid(format!("size out of range: {t:?}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memparse_suffixes() {
        assert_eq!(parse_size_bytes("4096").unwrap(), 4096);
        assert_eq!(parse_size_bytes("1K").unwrap(), 1024);
        assert_eq!(parse_size_bytes("1k\n").unwrap(), 1024);
        assert_eq!(parse_size_bytes("2M").unwrap(), 2 << 20);
        assert_eq!(parse_size_bytes("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size_bytes("100G").unwrap(), 100 << 30);
        assert_eq!(parse_size_bytes("0x1000").unwrap(), 4096);
        assert_eq!(parse_size_bytes("0").unwrap(), 0);
    }

    #[test]
    fn memparse_rejects_garbage() {
        for bad in ["", "K", "12Q", "-1", "1.5G", "abc", "99999999999999999999"] {
            assert_eq!(
                parse_size_bytes(bad).unwrap_err().kind(),
                crate::ErrorKind::InvalidArgument,
                "{bad:?}"
            );
        }
        assert!(parse_size_bytes("16E").is_err());
    }

    #[test]
    fn memparse_as_the_kernel() {
        for (text, v) in [
            ("4096", 4096),
            ("26214400\n", 26214400),
            ("25M\n", 25 << 20),
            ("1g", 1 << 30),
            ("0x1000", 4096),
            ("0x", 0),
            ("010", 8),
            ("010K", 8 << 10),
            ("12Q", 12),
            ("12 MB", 12),
            ("1.5G", 1),
            ("foo", 0),
            (" 1G", 0),
            ("-1", 0),
            ("", 0),
            ("16E", 0),
            ("8E", 1 << 63),
        ] {
            assert_eq!(memparse(text).unwrap(), v, "{text:?}");
        }
        assert!(memparse("99999999999999999999").is_err());
    }

    #[test]
    fn kstrtobool_like_the_kernel() {
        for t in ["1", "y\n", "Yes", "on", "ON", "true"] {
            assert!(kstrtobool(t).unwrap(), "{t}");
        }
        for f in ["0", "n", "No", "off\n", "false"] {
            assert!(!kstrtobool(f).unwrap(), "{f}");
        }
        for bad in ["", "2", "o", "x"] {
            assert!(kstrtobool(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn kstrtoint_like_the_kernel() {
        assert_eq!(kstrtoint("1\n", 10).unwrap(), 1);
        assert_eq!(kstrtoint("-3", 10).unwrap(), -3);
        assert_eq!(kstrtoint("+3", 10).unwrap(), 3);
        for bad in ["", "-", "--1", "-+1", "+-1", "1x", " 1", "1\n\n"] {
            assert_eq!(
                kstrtoint(bad, 10).unwrap_err().kind(),
                ErrorKind::InvalidArgument,
                "{bad:?}"
            );
        }
        for big in ["2147483648", "-2147483649", "99999999999999999999"] {
            assert_eq!(
                kstrtoint(big, 10).unwrap_err().kind(),
                ErrorKind::OutOfRange,
                "{big:?}"
            );
        }
        assert_eq!(kstrtoint("-2147483648", 10).unwrap(), i32::MIN);
    }

    #[test]
    fn kstrtou64_like_the_kernel() {
        assert_eq!(kstrtou64("1", 10).unwrap(), 1);
        assert_eq!(kstrtou64("1\n", 10).unwrap(), 1);
        assert_eq!(kstrtou64("+7", 10).unwrap(), 7);
        assert_eq!(kstrtou64("0x10", 0).unwrap(), 16);
        assert_eq!(kstrtou64("010", 0).unwrap(), 8);
        for bad in ["", "\n", " 1", "1 ", "1x", "-1", "1\n\n"] {
            assert_eq!(
                kstrtou64(bad, 10).unwrap_err().kind(),
                ErrorKind::InvalidArgument
            );
        }
        assert_eq!(
            kstrtou64("99999999999999999999", 10).unwrap_err().kind(),
            ErrorKind::OutOfRange
        );
    }
}
