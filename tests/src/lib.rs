//! Cross-process test harness.
