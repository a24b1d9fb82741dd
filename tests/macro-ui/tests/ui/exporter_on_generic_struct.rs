use kiln::exporter;

#[exporter(keys = ["Linear"])]
struct Generic<T>(T);

fn main() {}
