//! PKCS#11 modules by name, as p11-kit registers them: `module-name=NAME` in a key URI (RFC 7512)
//! names the module that a `NAME.module` file of p11-kit's configuration points at, so a URI
//! need not carry a library path that differs between distributions and architectures.
//!
//! The files are read the way p11-kit reads them (`pkcs11.conf(5)`): the user's
//! `~/.config/pkcs11/modules` first, then `/etc/pkcs11/modules`, then the packages'
//! `/usr/share/p11-kit/modules`; the first file of a name wins. Like p11-kit, hwkey skips the
//! user's files when it runs as root (or `P11_NO_USER_CONFIG` is set): a root service must not
//! load a library named by a file in a home directory. A file holds `key: value` lines; `module:` is the library (a relative path is
//! under p11-kit's module directory), and `enable-in:` / `disable-in:` limit the programs that
//! load it (hwkey honours them under the name `hwkey`).
//!
//! A URI with neither `module-path` nor `module-name` (and no `HWKEY_PKCS11_MODULE`) uses
//! p11-kit's proxy module when it is installed: every registered module's tokens at once.

use std::path::{Path, PathBuf};

use super::KeyError;
use crate::key::LocateError;

/// The program name `enable-in:` / `disable-in:` are matched against.
const PROGRAM: &str = "hwkey";

/// p11-kit's configuration directories of modules, most specific first.
pub fn config_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if user_config_allowed() {
        if let Some(home) = std::env::var_os("HOME").filter(|h| !h.is_empty()) {
            dirs.push(Path::new(&home).join(".config/pkcs11/modules"));
        }
    }
    dirs.push(PathBuf::from("/etc/pkcs11/modules"));
    dirs.push(PathBuf::from("/usr/share/p11-kit/modules"));
    dirs
}

/// p11-kit reads no user configuration as root or with `P11_NO_USER_CONFIG`; neither does hwkey.
pub fn user_config_allowed() -> bool {
    crate::state_dir::own_uid() != 0 && std::env::var_os("P11_NO_USER_CONFIG").is_none()
}

/// The directories p11-kit resolves a relative `module:` path against (Debian's multiarch one,
/// then the plain one).
fn module_dirs() -> [PathBuf; 2] {
    [
        PathBuf::from(format!(
            "/usr/lib/{}-linux-gnu/pkcs11",
            std::env::consts::ARCH
        )),
        PathBuf::from("/usr/lib/pkcs11"),
    ]
}

/// p11-kit's proxy module (package `p11-kit-modules`), when installed.
pub fn proxy_module() -> Option<PathBuf> {
    [
        PathBuf::from(format!(
            "/usr/lib/{}-linux-gnu/p11-kit-proxy.so",
            std::env::consts::ARCH
        )),
        PathBuf::from("/usr/lib/p11-kit-proxy.so"),
    ]
    .into_iter()
    .find(|p| p.is_file())
}

/// One registered module.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registered {
    /// Its name (the file name without `.module`).
    pub name: String,
    /// The library, resolved.
    pub path: PathBuf,
    /// The file that registered it.
    pub file: PathBuf,
}

/// The library registered as `name`.
pub fn resolve(name: &str) -> Result<PathBuf, KeyError> {
    resolve_in(name, &config_dirs())
}

fn resolve_in(name: &str, dirs: &[PathBuf]) -> Result<PathBuf, KeyError> {
    let not_found = |known: Vec<String>| {
        KeyError::Locate(LocateError::UnknownModuleName {
            name: name.to_string(),
            known,
            dirs: dirs.into(),
            user_skipped: !user_config_allowed(),
        })
    };
    if name.is_empty() || name.contains('/') || name.starts_with('.') {
        return Err(not_found(names_in(dirs)));
    }
    for dir in dirs {
        let file = dir.join(format!("{name}.module"));
        match std::fs::read_to_string(&file) {
            Ok(text) => {
                return match parse(name, &file, &text) {
                    Some(m) => Ok(m.path),
                    None => Err(KeyError::Locate(LocateError::ModuleNameUnusable {
                        name: name.to_string(),
                        file,
                    })),
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(KeyError::io("read the p11-kit module file", file, e)),
        }
    }
    Err(not_found(names_in(dirs)))
}

/// Every module registered for hwkey, by name (the first file of a name wins).
pub fn registered_modules() -> Vec<Registered> {
    list_in(&config_dirs())
}

fn list_in(dirs: &[PathBuf]) -> Vec<Registered> {
    let mut out: Vec<Registered> = Vec::new();
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        let mut files: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
        files.sort();
        for file in files {
            let Some(name) = file
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".module"))
                .filter(|n| !n.starts_with('.'))
                .map(str::to_string)
            else {
                continue;
            };
            if out.iter().any(|m| m.name == name) {
                continue;
            }
            let Ok(text) = crate::small_file::read_to_string(&file) else {
                continue;
            };
            if let Some(m) = parse(&name, &file, &text) {
                out.push(m);
            }
        }
    }
    out
}

fn names_in(dirs: &[PathBuf]) -> Vec<String> {
    list_in(dirs).into_iter().map(|m| m.name).collect()
}

/// Reads a `.module` file: None when it names no library or is not for hwkey.
fn parse(name: &str, file: &Path, text: &str) -> Option<Registered> {
    let mut module = None;
    let mut enabled = true;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let (key, value) = (key.trim(), value.trim());
        let programs = || value.split(',').map(str::trim).any(|p| p == PROGRAM);
        match key {
            "module" if !value.is_empty() => module = Some(PathBuf::from(value)),
            "enable-in" => enabled = programs(),
            "disable-in" if programs() => enabled = false,
            _ => {}
        }
    }
    let module = module.filter(|_| enabled)?;
    let path = if module.is_absolute() {
        module
    } else {
        let dirs = module_dirs();
        dirs.iter()
            .map(|d| d.join(&module))
            .find(|p| p.is_file())
            .unwrap_or_else(|| dirs[0].join(&module))
    };
    Some(Registered {
        name: name.to_string(),
        path,
        file: file.to_path_buf(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn module_files_are_read_as_p11_kit_reads_them() {
        let f = Path::new("/x/a.module");
        let m = parse(
            "a",
            f,
            "# comment\n\nmodule: /usr/lib/softhsm/libsofthsm2.so\ncritical: no\n",
        )
        .expect("a module");
        assert_eq!(m.path, Path::new("/usr/lib/softhsm/libsofthsm2.so"));
        let rel = parse("o", f, "module: opensc-pkcs11.so\n").expect("relative");
        assert!(
            rel.path.ends_with("pkcs11/opensc-pkcs11.so"),
            "{:?}",
            rel.path
        );
        assert!(parse("n", f, "critical: yes\n").is_none(), "no module line");
        assert!(parse("d", f, "module: /m.so\ndisable-in: ssh, hwkey\n").is_none());
        assert!(parse("e", f, "module: /m.so\nenable-in: firefox\n").is_none());
        assert!(parse("e", f, "module: /m.so\nenable-in: firefox, hwkey\n").is_some());
    }

    /// The first directory holding a name wins (the user's over the admin's over the
    /// packages'), as in p11-kit; an unknown name lists what is registered.
    #[test]
    fn the_most_specific_registration_wins() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let user = tmp.path().join("user");
        let system = tmp.path().join("system");
        for (dir, lib) in [(&user, "/user/m.so"), (&system, "/system/m.so")] {
            std::fs::create_dir_all(dir).expect("mkdir");
            std::fs::write(dir.join("hsm.module"), format!("module: {lib}\n")).expect("write");
        }
        std::fs::write(system.join("other.module"), "module: /o.so\n").expect("write");
        let dirs = [user.clone(), system.clone()];
        assert_eq!(
            resolve_in("hsm", &dirs).expect("found"),
            Path::new("/user/m.so")
        );
        assert_eq!(
            resolve_in("other", &dirs).expect("found"),
            Path::new("/o.so")
        );
        match resolve_in("none", &dirs) {
            Err(KeyError::Locate(LocateError::UnknownModuleName { known, .. })) => {
                assert_eq!(known, ["hsm", "other"])
            }
            other => panic!("{other:?}"),
        }
    }
}
