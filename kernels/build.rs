//! With the `mlx` feature on Linux, kiln links MLX's shared library (scripts/mlx/setup.sh): the
//! binaries find it through an rpath to the folder the patched mlx-sys names.

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_MLX_LIBDIR");
    if let Ok(dir) = std::env::var("DEP_MLX_LIBDIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
