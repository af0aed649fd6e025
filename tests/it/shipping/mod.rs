//! What ships: the Debian package and the approver image, the deploy manifests, builds with each
//! backend feature, a clean root with nothing but the package installed, and the README's demo.

#[cfg(all(feature = "pkcs11", feature = "tpm"))]
mod approver_image;
mod build_features;
#[cfg(all(feature = "pkcs11", feature = "tpm"))]
mod clean_root;
#[cfg(feature = "pkcs11")]
mod demo;
#[cfg(feature = "pkcs11")]
mod deploy;
#[cfg(all(feature = "pkcs11", feature = "tpm"))]
mod packaging;
