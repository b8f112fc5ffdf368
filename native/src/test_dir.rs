//! A test's own directory under the system's temporary one, removed when the test is done with
//! it, a failed test's included (the tests' files must not pile up in /tmp from run to run).

use std::ops::Deref;
use std::path::{Path, PathBuf};

pub struct TestDir(PathBuf);

impl TestDir {
    /// `trillium-test-<pid>-<name>`: names are unique within a test binary, the pid across runs.
    pub fn new(name: &str) -> Self {
        let d = std::env::temp_dir().join(format!("trillium-test-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        TestDir(d)
    }
}

impl Deref for TestDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
