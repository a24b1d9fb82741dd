use kiln::{exporter, ModuleExporter};

#[exporter(keys = [])]
struct Empty;
impl ModuleExporter for Empty {}

fn main() {}
