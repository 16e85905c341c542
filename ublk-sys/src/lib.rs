//! The Linux ublk uapi (`include/uapi/linux/ublk_cmd.h`, plus the zone types of
//! `linux/blkzoned.h`) as Rust bindings, for libublk.
//!
//! `ublk_cmd.rs` is the file crates.io's `libublk-rs-sys` 0.1.2 generates at build time with
//! bindgen (its build script, unchanged: the same header, allowlist and serde derives), checked
//! in so that no build needs bindgen or libclang. `scripts/ublk-bindings` makes it again (on a
//! machine with libclang) and says whether it changed. The crate has the public items of the
//! one it replaces: the generated constants and structs, and the two helpers below that convert
//! `ublk_auto_buf_reg` to and from an SQE address.
//!
//! The file holds what the header means on x86_64: ioctl numbers encoded as asm-generic's
//! `_IOC` and 64-bit alignment of `__u64`. Other 64-bit architectures with the generic ioctl
//! encoding read it the same; the others (32-bit ones, powerpc, mips, sparc, alpha) are refused
//! at compile time rather than given wrong numbers. The generated layout tests
//! (`bindgen_test_layout_*`) check every struct's size, alignment and field offsets.

#[cfg(not(all(
    target_os = "linux",
    any(
        target_arch = "x86_64",
        target_arch = "aarch64",
        target_arch = "riscv64",
        target_arch = "loongarch64"
    )
)))]
compile_error!(
    "ublk-sys/src/ublk_cmd.rs holds the ublk uapi of 64-bit Linux with asm-generic ioctl numbers; \
     run scripts/ublk-bindings on this architecture (it needs libclang) or build without the \
     `ublk` feature"
);

/// The generated bindings: bindgen's output, which neither follows this workspace's lints
/// (its layout tests and `__IncompleteArrayField` use `unsafe` without SAFETY comments) nor
/// its formatting; its own unsafe code is bindgen's, as in the crate this replaces.
#[allow(
    non_upper_case_globals,
    non_camel_case_types,
    non_snake_case,
    dead_code,
    clippy::all,
    clippy::undocumented_unsafe_blocks,
    unsafe_op_in_unsafe_fn
)]
mod generated {
    include!("ublk_cmd.rs");
}

pub use generated::*;

/// The `ublk_auto_buf_reg` packed in an SQE's `addr` (`UBLK_F_AUTO_BUF_REG`): bits 0-15 the
/// buffer index, 16-23 the flags; the reserved fields are not carried and come back zero.
#[inline(always)]
pub fn ublk_sqe_addr_to_auto_buf_reg(sqe_addr: u64) -> ublk_auto_buf_reg {
    ublk_auto_buf_reg {
        index: sqe_addr as u16,
        flags: (sqe_addr >> 16) as u8,
        ..Default::default()
    }
}

/// `buf` packed as an SQE's `addr`: bits 0-15 the index, 16-23 the flags, 24-31 `reserved0`,
/// 32-63 `reserved1` (the header's `ublk_auto_buf_reg_to_sqe_addr`).
#[inline(always)]
pub fn ublk_auto_buf_reg_to_sqe_addr(buf: &ublk_auto_buf_reg) -> u64 {
    buf.index as u64
        | (buf.flags as u64) << 16
        | (buf.reserved0 as u64) << 24
        | (buf.reserved1 as u64) << 32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_buf_reg_packs_as_the_header_says() {
        let buf = ublk_auto_buf_reg {
            index: 0x1234,
            flags: 0xab,
            reserved0: 0xcd,
            reserved1: 0xdead_beef,
        };
        let addr = ublk_auto_buf_reg_to_sqe_addr(&buf);
        assert_eq!(addr, 0xdead_beef_cdab_1234);
        let back = ublk_sqe_addr_to_auto_buf_reg(addr);
        assert_eq!(
            (back.index, back.flags, back.reserved0, back.reserved1),
            (0x1234, 0xab, 0, 0)
        );
    }

    /// The ioctl-encoded commands, worked out by hand from `_IOWR('u', nr, struct
    /// ublksrv_ctrl_cmd)` (32 bytes) and `_IOWR('u', nr, struct ublksrv_io_cmd)` (16 bytes): the
    /// numbers the kernel compares, so a wrong encoding in the checked-in file fails here.
    #[test]
    fn ioctl_numbers_are_asm_generic_iowr() {
        const fn iowr(nr: u32, size: u32) -> u32 {
            (3 << 30) | (size << 16) | ((b'u' as u32) << 8) | nr
        }
        const fn ior(nr: u32, size: u32) -> u32 {
            (2 << 30) | (size << 16) | ((b'u' as u32) << 8) | nr
        }
        assert_eq!(std::mem::size_of::<ublksrv_ctrl_cmd>(), 32);
        assert_eq!(std::mem::size_of::<ublksrv_io_cmd>(), 16);
        assert_eq!(UBLK_U_CMD_ADD_DEV, iowr(UBLK_CMD_ADD_DEV, 32));
        assert_eq!(UBLK_U_CMD_START_DEV, iowr(UBLK_CMD_START_DEV, 32));
        assert_eq!(UBLK_U_CMD_SET_PARAMS, iowr(UBLK_CMD_SET_PARAMS, 32));
        assert_eq!(UBLK_U_CMD_GET_DEV_INFO, ior(UBLK_CMD_GET_DEV_INFO, 32));
        assert_eq!(UBLK_U_IO_FETCH_REQ, iowr(UBLK_IO_FETCH_REQ, 16));
        assert_eq!(
            UBLK_U_IO_COMMIT_AND_FETCH_REQ,
            iowr(UBLK_IO_COMMIT_AND_FETCH_REQ, 16)
        );
        assert_eq!(UBLK_U_IO_PREP_IO_CMDS, 0xc010_7525);
    }
}
