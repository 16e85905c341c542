//! Sizes with zram's suffixes, and the constants every layer shares.

use crate::error::{Error, Result};

/// The block layer's sector: the unit of I/O alignment (`offset` and `len` of every request are
/// multiples of it), as in the kernel.
pub const SECTOR_SIZE_BYTES: u64 = 512;

/// Page sizes a device may be created with (the kernel's 4 KiB, 16 KiB and 64 KiB pages).
pub const SUPPORTED_PAGE_SIZES_BYTES: [usize; 3] = [4096, 16384, 65536];

/// The default page size.
pub const DEFAULT_PAGE_SIZE_BYTES: usize = 4096;

/// Parses a size the way the kernel's `memparse()` does, as zram's `disksize` and `mem_limit`
/// do: a decimal (or `0x` hex) number with an optional `K`, `M`, `G`, `T`, `P` or `E` suffix
/// (either case, powers of 1024). Surrounding whitespace and a trailing newline are ignored.
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
}
