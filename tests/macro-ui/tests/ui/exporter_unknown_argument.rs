use kiln::{exporter, ModuleExporter};

#[exporter(keys = ["Linear"], colour = 1)]
struct Unknown;
impl ModuleExporter for Unknown {}

fn main() {}
