//! Tables of bad input: each errno with the values refused with it, checked by one helper.

/// Asserts that `attempt` refuses every value of `table` with the errno the value is listed
/// under, and that `unchanged(value)` holds after each refusal (the rule that bad input gets
/// an error and changes nothing: `unchanged` asserts the state the test recorded before).
/// `attempt` returns the errno it failed with, or `None` when it succeeded.
pub fn assert_refused(
    table: &[(i32, &[&str])],
    mut attempt: impl FnMut(&str) -> Option<i32>,
    mut unchanged: impl FnMut(&str),
) {
    for &(errno, values) in table {
        for &value in values {
            assert_eq!(
                attempt(value),
                Some(errno),
                "{value:?}: want errno {errno} ({})",
                std::io::Error::from_raw_os_error(errno)
            );
            unchanged(value);
        }
    }
}

/// The errno of `r` if it failed, `None` if it succeeded: the `attempt` of
/// [`assert_refused`] over a device's attribute store.
pub fn errno_of<T>(r: uzram::Result<T>) -> Option<i32> {
    r.err().map(|e| e.errno())
}
