//! Turns on `cfg(blkq_rbd)` (the `rbd:` device) and links librbd and librados when the `rbd`
//! feature is on and librbd's header and library are installed (Debian: `librbd-dev`).
//! `BLKQ_RBD=0` in the environment turns it off (a build as on a machine without librbd).

use std::path::Path;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(blkq_rbd)");
    println!("cargo::rerun-if-env-changed=BLKQ_RBD");
    println!("cargo::rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_RBD").is_none()
        || std::env::var("BLKQ_RBD").is_ok_and(|v| v == "0")
    {
        return;
    }
    let include = ["/usr/include", "/usr/local/include"];
    let Some(header) = include
        .iter()
        .map(|d| Path::new(d).join("rbd/librbd.h"))
        .find(|p| p.exists())
    else {
        println!(
            "cargo::warning=librbd not found (no rbd/librbd.h): building without the rbd: \
             device (apt-get install librbd-dev, then rebuild)"
        );
        return;
    };
    println!("cargo::rerun-if-changed={}", header.display());
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let libdirs = [
        format!("/usr/lib/{arch}-linux-gnu"),
        "/usr/lib64".to_string(),
        "/usr/lib".to_string(),
        "/usr/local/lib".to_string(),
        "/usr/local/lib64".to_string(),
    ];
    let found = |lib: &str| {
        libdirs
            .iter()
            .find(|d| Path::new(d).join(format!("lib{lib}.so")).exists())
            .cloned()
    };
    match (found("rbd"), found("rados")) {
        (Some(rbd), Some(rados)) => {
            println!("cargo::rustc-link-search=native={rbd}");
            if rados != rbd {
                println!("cargo::rustc-link-search=native={rados}");
            }
            println!("cargo::rustc-cfg=blkq_rbd");
        }
        _ => println!(
            "cargo::warning=librbd's header is installed but not librbd.so/librados.so: \
             building without the rbd: device (apt-get install librbd-dev)"
        ),
    }
}
