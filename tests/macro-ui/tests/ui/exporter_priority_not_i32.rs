use kiln::{exporter, ModuleExporter};

#[exporter(keys = ["Linear"], priority = 3000000000)]
struct TooBig;
impl ModuleExporter for TooBig {}

fn main() {}
