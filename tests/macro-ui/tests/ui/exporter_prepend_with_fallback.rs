use kiln::{exporter, ModuleExporter};

#[exporter(keys = ["Linear"], prepend, fallback)]
struct Both;
impl ModuleExporter for Both {}

fn main() {}
