use kiln::exporter;

#[exporter(keys = ["Linear"])]
fn not_a_struct() {}

fn main() {}
