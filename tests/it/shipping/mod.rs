//! What ships: the Debian package and the approver image, the deploy manifests, builds with each
//! backend feature, and a clean root with nothing but the package installed.

#[cfg(all(feature = "pkcs11", feature = "tpm"))]
mod approver_image;
mod build_features;
#[cfg(all(feature = "pkcs11", feature = "tpm"))]
mod clean_root;
#[cfg(feature = "pkcs11")]
mod deploy;
#[cfg(all(feature = "pkcs11", feature = "tpm"))]
mod packaging;
