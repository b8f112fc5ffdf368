module trillium/linkdelay

go 1.26
