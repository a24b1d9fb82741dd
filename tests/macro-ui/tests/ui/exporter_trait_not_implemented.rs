use kiln::exporter;

#[exporter(keys = ["Linear"])]
struct Forgot;

fn main() {}
