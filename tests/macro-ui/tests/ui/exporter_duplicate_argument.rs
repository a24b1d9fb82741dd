use kiln::{exporter, ModuleExporter};

#[exporter(keys = ["Linear"], priority = 1, priority = 2)]
struct Twice;
impl ModuleExporter for Twice {}

fn main() {}
